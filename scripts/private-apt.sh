# Sourced by the scripts that fetch a pinned package from another Debian release
# (install-victoria-metrics.sh, install-prometheus-lts.sh): an apt sources list and state of their
# own, so that the machine's apt configuration is not touched and nothing is installed.
#
#     private_apt SUITE DIR WHAT
#
# points apt at SUITE of the archive this machine already uses (the first deb.debian.org-style URI
# in its sources, so a mirror configured there is used here too), keeps apt's lists and downloads in
# DIR, says it fetches WHAT (words for people), reads the archive's index once, and leaves in `apt_private` the options to run apt-get with
# (`apt-get "${apt_private[@]}" download PACKAGE=VERSION` in DIR) and in `mirror` the archive's URI.

private_apt() {
    local suite=$1 dir=$2 what=$3
    mirror="$(
        { grep -rhs '^URIs:' /etc/apt/sources.list.d/ | awk '{print $2}'
          grep -hs '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list | awk '{print $2}'; } \
        | grep -v -- '-security' | grep -m1 'debian' || true
    )"
    mirror="${mirror:-http://deb.debian.org/debian}"
    mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial"
    echo "deb $mirror $suite main" > "$dir/sources.list"
    apt_private=(
        -o "Dir::Etc::SourceList=$dir/sources.list"
        -o "Dir::Etc::SourceParts=$dir/none"
        -o "Dir::State::Lists=$dir/lists"
        -o "Dir::Cache=$dir/cache"
        -o "APT::Sandbox::User=$(id -un)"
    )
    echo "fetching $what from Debian $suite ($mirror), once" >&2
    apt-get -qq "${apt_private[@]}" update >&2
}
