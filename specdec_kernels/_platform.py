"""Facts about the machine, for `specdec info` and the benchmark records."""

import platform


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (e.g. "AMD EPYC"), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
