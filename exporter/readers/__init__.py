"""Readers: the only code that touches the kernel log, sysfs and NVML.

Each reader returns typed, frozen values; collectors turn those into metric families.
"""
