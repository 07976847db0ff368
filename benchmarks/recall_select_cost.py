"""The recall selection's cost at 2K tokens, one layer (issue 34): TwoStageCodes.top_pages of this tree against
another tree's two_stage.py (digests.py before it moved there; its path, the first argument), in one process, CPU time, one thread, the same picks asserted.

    python benchmarks/recall_select_cost.py /path/to/old/h2ochat/recall/two_stage.py
"""
import importlib.util, sys, time, torch
torch.set_num_threads(1)
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
import h2ochat.recall.two_stage as new
spec = importlib.util.spec_from_file_location("h2ochat.recall.digests_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
B, H, D, P, T = 1, 3, 64, 16, 1920
g = torch.Generator().manual_seed(0)
keys = torch.randn(B, H, T, D, generator=g); idx = torch.arange(T).expand(B, H, T)
q = torch.randn(B, H, 3, D, generator=g)
def make(mod):
    d = mod.TwoStageCodes(B, H, D, P, 4, rotate=True)
    d.append(keys, idx)
    return d
a, b = make(old), make(new)
b.tokens.rotation = a.tokens.rotation
assert torch.equal(a.top_pages(q, 3), b.top_pages(q, 3))
for name, d in (("old", a), ("new", b), ("old", a), ("new", b)):
    t = time.process_time()
    for _ in range(300):
        d.top_pages(q, 3)
    print(name, "ms per top_pages (one layer)", round((time.process_time() - t) / 300 * 1000, 3))
