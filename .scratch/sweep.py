"""Compiles every knob combination of the fast-form seeds through evaluator.build.build_fast."""
import itertools, re, sys, pathlib, concurrent.futures as cf
sys.path.insert(0, "/work/main")
from evaluator.build import build_fast
KNOB = re.compile(r"^(\s*#define\s+(\w+)\s+)(\S+)(\s*//\s*evoattn:\s*choice\((.*)\).*)$")
def variants(path):
    lines = pathlib.Path(path).read_text().splitlines(keepends=True)
    knobs = [(i, m) for i, l in enumerate(lines) if (m := KNOB.match(l.rstrip("\n")))]
    choices = [[c.strip() for c in m.group(5).split(",")] for _, m in knobs]
    for combo in itertools.product(*choices):
        out = list(lines)
        for (i, m), val in zip(knobs, combo):
            out[i] = m.group(1) + val + m.group(4) + "\n"
        yield dict(zip([m.group(2) for _, m in knobs], combo)), "".join(out)
def one(args):
    name, combo, text, n = args
    p = pathlib.Path(f"/tmp/knobs/src/{name}_{n}.cu"); p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    r = build_fast(p, "/tmp/knobs/cache", "sm_90a", 600)
    warn = "warning" in r.log.lower()
    return name, combo, r.ok, warn, r.log
jobs = []
for name in sys.argv[1:]:
    for n, (combo, text) in enumerate(variants(f"/work/main/seeds/sdpa/{name}.cu")):
        jobs.append((name, combo, text, n))
ok = bad = 0
with cf.ThreadPoolExecutor(2) as ex:
    for name, combo, good, warn, log in ex.map(one, jobs):
        ok += good; bad += not good
        if not good or warn: print(name, combo, "OK" if good else "FAIL", log[:800], flush=True)
print(f"compiled {ok} ok, {bad} failed of {len(jobs)}", flush=True)
