"""A process's resident memory from Linux's /proc (imports no framework)."""


def proc_status(field: str) -> int:
    """A `/proc/self/status` size in bytes (`"VmRSS"`, `"VmHWM"`, ...)."""
    with open("/proc/self/status") as file:
        for line in file:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_resident() -> int:
    """Resets the peak resident memory (`VmHWM`) to the current one and
    returns that (`VmRSS`), the baseline a peak is measured above."""
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")
    return proc_status("VmRSS")
