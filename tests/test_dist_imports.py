"""What a rank does to DeepSpeed's imports before its process group exists (toolkit.process.dist)."""

import cpuinfo


def test_deepspeeds_cpu_queries_start_one_cpuinfo_subprocess_per_rank_not_three(monkeypatch):
    """DeepSpeed's op builder (cpu_arch, simd_width) and DeepSpeedCPUAdam each call py-cpuinfo's get_cpu_info,
    which starts a Python subprocess per call (~1.1 s): the rank keeps the first answer."""
    from toolkit.process.dist import cache_cpu_info

    calls = []

    def query() -> dict:
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2"], "vendor_id_raw": "GenuineIntel"}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", query)
    cache_cpu_info()
    cache_cpu_info()  # again (another import path): still one query under it
    from cpuinfo import get_cpu_info  # as DeepSpeed imports it, at each call

    first = get_cpu_info()
    first["flags"].append("changed by a caller")
    assert get_cpu_info() == get_cpu_info() == query()  # the same answer, each a copy of its own
    assert len(calls) == 2  # the cached query and the direct one above
