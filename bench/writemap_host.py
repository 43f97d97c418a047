"""The write map's host check (the CPU path of the step check): time per step at N tokens,
decode and extend, liveness off and on, beside the bounds-only host scan in the same run.

    .venv/bin/python bench/writemap_host.py
"""
import os, sys, time, random
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tests"))
import torch
from test_writemap import model_runner, forward_batch
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang_oobguard.probes import hostmap, hostscan, shadow
from sglang_oobguard.model import writemap

def case(n, family):
    rows = min(n, 4096) if family == "decode" else 8
    pool = ReqToTokenPool(size=rows, max_context_len=4200, device="cpu", enable_memory_saver=False)
    high = (rows + 1) * 4200 + 2
    pool.req_to_token.copy_(torch.randperm(high - 2)[: (rows + 1) * 4200].view(rows + 1, 4200).to(torch.int32) + 1)
    rpi = list(range(1, rows + 1))
    if family == "decode":
        seq = [random.randint(1, 4000) for _ in rpi]
        loc = pool.req_to_token[torch.tensor(rpi), torch.tensor(seq) - 1].long()
        b = forward_batch("DECODE", rpi, seq, loc)
    else:
        counts = [n // 8] * 8
        prefix = [random.randint(0, 100) for _ in rpi]
        loc = torch.cat([pool.req_to_token[r, p:p + c].long() for r, p, c in zip(rpi, prefix, counts)])
        starts = torch.tensor([sum(counts[:i]) for i in range(8)], dtype=torch.int32)
        b = forward_batch("EXTEND", rpi, [p + c for p, c in zip(prefix, counts)], loc,
                          extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
                          extend_seq_lens=torch.tensor(counts, dtype=torch.int32), extend_start_loc=starts)
    live = shadow.new_live(high, 1, torch.device("cpu"))
    live.flags.fill_(1)
    return b, model_runner(pool), high, live

for family in ("decode", "extend"):
    for n in (1, 16, 256, 4096):
        if family == "extend" and n < 8: continue
        b, runner, high, live = case(n, family)
        for lv in (None, live):
            reps = 2000 if n <= 256 else 200
            t0 = time.perf_counter()
            for _ in range(reps):
                rule = writemap.rule_of(b, runner)
                f, _, _ = hostmap.check_host(rule, high, lv)
            dt = (time.perf_counter() - t0) / reps * 1e6
            assert f is None
            print(f"{family:7s} N={n:5d} liveness={'on ' if lv else 'off'}: {dt:8.1f} us/step (rule_of + check_host)")
print("baseline: hostscan.scan_host (the bounds and liveness check alone), same run")
for n in (1, 16, 256, 4096):
    b, runner, high, live = case(n, "decode")
    for lv in (None, live):
        reps = 2000 if n <= 256 else 200
        t0 = time.perf_counter()
        for _ in range(reps):
            hostscan.scan_host(b.out_cache_loc, high, None, lv)
        dt = (time.perf_counter() - t0) / reps * 1e6
        print(f"scan_host N={n:5d} liveness={'on ' if lv else 'off'}: {dt:8.1f} us/step")
