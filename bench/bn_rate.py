"""BatchNorm's training step on the GPU by shape, dtype and memory format; then where a compiled
ResNet-50 step spends its device time, by kernel."""
import statistics, sys, time
import torch
import torch.nn.functional as F

def timed(fn, n=10):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - s)
    return statistics.median(ts)

def bn_case(shape, dtype, fmt):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    if fmt == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    c = shape[1]
    w = torch.ones(c, device="cuda", requires_grad=True); b = torch.zeros(c, device="cuda", requires_grad=True)
    rm = torch.zeros(c, device="cuda"); rv = torch.ones(c, device="cuda")
    g = torch.randn_like(x)
    def fwd():
        return F.batch_norm(x, rm, rv, w, b, training=True)
    def both():
        y = fwd(); y.backward(g)
    tf = timed(fwd); tb = timed(both)
    nbytes = x.numel() * x.element_size()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        both(); torch.cuda.synchronize()
    kern = sorted(((e.self_device_time_total, e.key) for e in p.key_averages() if e.self_device_time_total > 0), reverse=True)[:2]
    print(f"bn {tuple(shape)} {str(dtype)[6:]} {fmt}: fwd {tf*1e3:.2f} ms ({2*nbytes/tf/1e9:.0f} GB/s for 2x), "
          f"fwd+bwd {tb*1e3:.2f} ms ({5*nbytes/tb/1e9:.0f} GB/s for 5x); kernels: "
          + "; ".join(f"{k[:70]} {t/1e3:.2f}ms" for t, k in kern), flush=True)

print("cudnn", torch.backends.cudnn.version(), "enabled", torch.backends.cudnn.enabled)
for shape in [(256, 64, 112, 112), (256, 256, 56, 56), (256, 512, 28, 28), (256, 1024, 14, 14), (256, 2048, 7, 7)]:
    for dtype in (torch.bfloat16, torch.float32):
        for fmt in ("nchw", "cl"):
            bn_case(shape, dtype, fmt)

if "--compiled" in sys.argv:
    sys.path.insert(0, ".")
    from stratagem.models import get_preset
    preset = get_preset("resnet-50")
    (inp,), tgt = preset.make_batch(256)
    inp, tgt = inp.cuda(), tgt.cuda()
    with torch.device("cuda"):
        model = preset.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cm = torch.compile(model)
    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = preset.loss(m(inp), tgt)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for label, m in (("eager", model), ("compiled", cm)):
        for _ in range(3): step(m)
        t = timed(lambda: step(m), n=5)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            step(m); torch.cuda.synchronize()
        groups = {}
        for e in p.key_averages():
            k = e.key.lower()
            g = ("triton" if "triton" in k else "conv/cudnn" if any(s in k for s in ("conv", "cudnn", "xmma", "sm90", "implicit", "wgrad", "dgrad", "fprop", "cutlass"))
                 else "bn" if "batch" in k or "bn_" in k else "other")
            groups[g] = groups.get(g, 0.0) + e.self_device_time_total / 1e3
        top = sorted(((e.self_device_time_total, e.key) for e in p.key_averages()), reverse=True)[:8]
        print(f"resnet-50 256 {label}: step {t*1e3:.1f} ms; device ms by group: "
              + ", ".join(f"{g} {v:.1f}" for g, v in sorted(groups.items(), key=lambda i: -i[1])), flush=True)
        print("   top kernels: " + "; ".join(f"{k[:60]} {v/1e3:.1f}" for v, k in top), flush=True)
