"""The CPU's identity as the kernel choice's cache key and the benchmark reports carry it."""
import platform

from wideserve.utils.cpu_id import CpuId, cpu_id, parse_cpuinfo

# Two processors of a KVM guest on a Zen 5 EPYC; the second's fields must not override the
# first's.
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu avx2 avx512f avx512_bf16

processor\t: 1
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
stepping\t: 8
flags\t\t: fpu amx_tile
"""


def test_the_first_processor_with_its_family_model_and_stepping():
    c = parse_cpuinfo(CPUINFO)
    assert (c.vendor, c.family, c.model, c.stepping) == ("AuthenticAMD", "26", "2", "1")
    assert c.model_name == "AMD EPYC"
    assert c.flags == frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})
    assert c.label() == "AMD EPYC (family 26 model 2 stepping 1)"


def test_two_classes_with_one_name_get_two_labels():
    zen4 = parse_cpuinfo(CPUINFO.replace("family\t: 26", "family\t: 25").replace(
        "model\t\t: 2", "model\t\t: 17"))
    assert zen4.model_name == parse_cpuinfo(CPUINFO).model_name
    assert zen4.label() != parse_cpuinfo(CPUINFO).label()


def test_no_numbers_no_parentheses_and_a_missing_file_is_no_error(tmp_path):
    assert CpuId(model_name="Apple M3").label() == "Apple M3"
    missing = cpu_id(tmp_path / "cpuinfo")
    assert missing.flags == frozenset() and missing.model_name


def test_an_entry_without_a_model_name_takes_the_platforms(tmp_path):
    arm = tmp_path / "cpuinfo"
    arm.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n\n")
    got = cpu_id(arm)
    assert got.model_name == (platform.processor() or "unknown") and got.flags == frozenset()
