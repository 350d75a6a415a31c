import re
from pathlib import Path

from telemetry.daemon.kmsg.classify import Classifier, UserPattern
from telemetry.daemon.kmsg.record import KmsgRecord, parse_record, parse_records

KMSG = Path(__file__).parents[1] / "fixtures" / "kmsg"
NO_MEMORY = ("NVRM: nvCheckOkFailedNoLog: Check failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) "
             "returned from _memdescAllocInternal(pMemDesc) @ mem_desc.c:1359")
XID_45 = "NVRM: Xid (PCI:0000:dc:00): 45, pid=1818990, name=python3, Ch 00000001"


def parse(text: str) -> KmsgRecord:
    record = parse_record(text)
    assert record is not None, text
    return record


def test_record_header_fields_and_continuation_lines():
    record = parse("6,1235,940000000,-;usb 1-1: new device\n SUBSYSTEM=usb\n DEVICE=c189:2\n")
    assert (record.level, record.facility, record.seq, record.usec, record.flags) == (6, 0, 1235, 940000000, "-")
    assert record.message == "usb 1-1: new device"
    assert record.properties == {"SUBSYSTEM": "usb", "DEVICE": "c189:2"}


def test_record_from_a_user_write_has_facility_user_and_extra_header_fields_are_ignored():
    record = parse("12,370,652437987,-,caller=T42;memtel hello")
    assert (record.facility, record.level, record.seq, record.message) == (1, 4, 370, "memtel hello")


def test_escaped_bytes_are_unescaped():
    assert parse("6,1,2,-;a\\x0ab\\x5cc").message == "a\nb\\c"


def test_plain_text_line_becomes_a_record_without_sequence():
    record = parse("Nov 29 10:00:00 host kernel: " + NO_MEMORY)
    assert record.seq is None and record.usec is None and NO_MEMORY in record.message
    assert parse_record("   \n") is None  # blank: no record


def test_real_kernel_log_fixture_parses_and_counts_nowhere():
    text = (KMSG / "x86_64-debian12-24g.kmsg").read_text()
    records = parse_records(text)
    headers = [line for line in text.splitlines() if not line.startswith(" ")]
    assert len(records) == len(headers)
    seqs = [r.seq or 0 for r in records]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # contiguous, continuation lines folded in
    assert any(r.properties.get("SUBSYSTEM") for r in records)
    classifier = Classifier()
    assert [r.message for r in records if classifier.classify(r)] == []


def test_unified_memory_fixture_counts_by_meaning():
    records = parse_records((KMSG / "dgx-spark__gb10__580.142.kmsg").read_text())
    kinds = [kind for r in records for kind in Classifier().classify(r)]
    assert kinds.count("nv_err_no_memory") == 16
    assert kinds.count("xid:45") == 3
    assert kinds.count("nvrm_error") == 19
    assert kinds.count("oom_kill") == 1
    assert len(kinds) == 16 + 3 + 19 + 1


def test_no_memory_matched_by_meaning_not_one_string():
    classify = Classifier().classify
    variants = [
        NO_MEMORY,
        "NVRM: nvAssertOkFailedNoLog: Assertion failed: Out of memory [NV_ERR_NO_MEMORY] (0x00000051) returned from x",
        "nvidia-uvm: uvm_mem_alloc failed: NV_ERR_NO_MEMORY",
        "NVRM: _memdescAllocInternal: allocation failed, status 0x51",
        "NVRM: rmapiAlloc: Out of memory while allocating class 0x50a0",
    ]
    for line in variants:
        assert "nv_err_no_memory" in classify(parse(line)), line
    for line in ("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  580.95.05",
                 "NVRM: GPU at PCI:0000:dc:00: GPU-1234", "some app: Out of memory (not the driver)",
                 "NVRM: Xid (PCI:0000:dc:00): 31, pid=1, name=python3, Ch 00000001, intr 10000000"):
        assert "nv_err_no_memory" not in classify(parse(line)), line


def test_xid_codes_and_formats():
    classify = Classifier().classify
    assert classify(parse(XID_45)) == ["xid:45", "nvrm_error"]
    assert "xid:13" in classify(parse("NVRM: Xid (0000:01:00): 13, Graphics Exception: ESR 0x404600"))
    assert "xid:79" in classify(parse("NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, "
                                             "GPU has fallen off the bus."))
    assert classify(parse("NVRM: Xid is a word here")) == ["nvrm_error"]


def test_oom_killer_lines_counted_once_per_kill():
    classify = Classifier().classify
    kill_new = "Out of memory: Killed process 1818990 (python3) total-vm:1452kB, anon-rss:1182kB, file-rss:0kB"
    kill_cg = "Memory cgroup out of memory: Killed process 4242 (vllm) total-vm:100kB, anon-rss:90kB"
    kill_old = "Killed process 77 (java) total-vm:100kB, anon-rss:90kB, file-rss:0kB"
    for line in (kill_new, kill_cg, kill_old):
        assert classify(parse(line)) == ["oom_kill"], line
    for line in ("python3 invoked oom-killer: gfp_mask=0x140dca, order=0", "Out of memory: Kill process 77 (java) "
                 "score 900 or sacrifice child", "oom_reaper: reaped process 1818990 (python3), now anon-rss:0kB"):
        assert classify(parse(line)) == [], line


def test_nvrm_error_by_words_or_kernel_level():
    classify = Classifier().classify
    assert classify(parse("NVRM: GPU 0000:01:00.0: RmInitAdapter failed! (0x22:0x38:827)")) == ["nvrm_error"]
    assert classify(parse("3,5,6,-;NVRM: something quiet")) == ["nvrm_error"]  # kernel, level err
    assert classify(parse("11,5,6,-;NVRM: something quiet")) == []  # a user write at level err


def test_user_patterns_add_kinds():
    classifier = Classifier((UserPattern("cuda_oom", re.compile(r"CUDA out of memory")),
                             UserPattern("any_nvrm", re.compile(r"NVRM"))))
    assert classifier.classify(parse(NO_MEMORY)) == ["nv_err_no_memory", "nvrm_error", "pattern:any_nvrm"]
    assert classifier.classify(parse("x: CUDA out of memory")) == ["pattern:cuda_oom"]
