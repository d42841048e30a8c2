"""The worker reads the CPU's features from /proc/cpuinfo: the tier it runs at, and the figures
that follow (rows for the quantized kernel, threads)."""

from __future__ import annotations

from worker_svc.cpu_features import QUANTIZED_MAX_ROWS, parse_cpuinfo, pick_threads

BASE = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ssse3 fma cx16 sse4_1 sse4_2"
AVX2 = BASE + " avx f16c avx2 bmi1 bmi2"
AVX512 = AVX2 + " avx512f avx512dq avx512cd avx512bw avx512vl"
ZEN4 = AVX512 + " avx512_bf16 avx512vbmi avx512_vbmi2 avx512_vnni avx512_bitalg"
SAPPHIRE = ZEN4 + " amx_bf16 avx512_fp16 amx_tile amx_int8"


def cpuinfo(flags: str, model: str = "Some CPU", siblings: int = 2, cores: int = 2) -> str:
    block = (
        f"processor\t: {{n}}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\n"
        f"siblings\t: {siblings}\ncpu cores\t: {cores}\nflags\t\t: {flags}\n"
        "bugs\t\t: spectre_v1\n\n"
    )
    return "".join(block.format(n=n) for n in range(2))


def test_avx2_only():
    cpu = parse_cpuinfo(cpuinfo(AVX2, "Intel(R) Core(TM) i7-8700"))
    assert cpu.tier == "avx2" and cpu.flags == {"avx2"}
    assert not cpu.bf16_native and cpu.model == "Intel(R) Core(TM) i7-8700"


def test_avx512_without_bf16_or_vnni():
    cpu = parse_cpuinfo(cpuinfo(AVX512))
    assert cpu.tier == "avx512" and not cpu.bf16_native
    assert cpu.flag_text() == "avx2 avx512f"


def test_avx512_bf16_and_vnni_without_amx():
    cpu = parse_cpuinfo(cpuinfo(ZEN4, "AMD EPYC"))
    assert cpu.tier == "avx512_bf16" and cpu.bf16_native
    assert cpu.flag_text() == "avx2 avx512f avx512_vnni avx512_bf16"


def test_amx():
    cpu = parse_cpuinfo(cpuinfo(SAPPHIRE, "Intel(R) Xeon(R) Platinum 8480+", 4, 2))
    assert cpu.tier == "amx" and cpu.bf16_native and {"amx_bf16", "amx_int8"} <= cpu.flags
    assert cpu.threads_per_core == 2
    assert cpu.quantized_max_rows == QUANTIZED_MAX_ROWS["amx"]


def test_no_flags_line_is_the_baseline():
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1\n\n"
    cpu = parse_cpuinfo(arm)
    assert cpu.tier == "baseline" and cpu.flags == frozenset() and cpu.flag_text() == "none"
    assert cpu.threads_per_core == 1
    assert parse_cpuinfo("").tier == "baseline"


def test_threads_one_per_physical_core_of_the_share():
    assert pick_threads(default=2, cpus=2, threads_per_core=1) == 2
    assert pick_threads(default=64, cpus=4, threads_per_core=1) == 4  # a container's share
    assert pick_threads(default=8, cpus=8, threads_per_core=2) == 4  # SMT siblings share units
    assert pick_threads(default=4, cpus=1, threads_per_core=2) == 1
