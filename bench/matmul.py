"""The d12 step's matmuls (B=16, T=1024, bf16) on the GPU: our forward/dX kernel on its pointer path
alone ("ptr") and as training runs it, the autotuner choosing between that and the tensor-descriptor path
("auto"), and our dW kernel, against cuBLAS; each product timed alone (median of triton.testing.do_bench,
L2 flushed) and checked against an fp32 product of the same bf16 inputs in the configuration the
autotuner picked, as training picks it. Prints one table.

    python bench/matmul.py [--batch-size 16]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt2_triton as tt  # noqa: E402
import train_gpt2_triton as tk  # noqa: E402


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(got, want):
    return ((got.float() - want).norm() / want.norm()).item()


def config_rankings(call, kernel):
    """[(config, the autotuner's median ms, ms of the product run alone in that config)] for the configs
    the autotuner times at call's shape, its pick first: where the two rankings disagree, its timing is
    not what training gets (seen at c_attn dX and attn.c_proj on the H100). Each config is pinned in turn
    by letting the pruning keep it alone, with the autotuner's cache cleared around every call."""
    prune = kernel.early_config_prune
    kernel.cache.clear()
    call()
    picked, tuned = kernel.best_config, dict(getattr(kernel, "configs_timings", None) or {})
    alone = {}
    try:
        for config in tuned:
            kernel.cache.clear()
            kernel.early_config_prune = lambda configs, named_args, config=config, **kwargs: [config]
            alone[config] = median_ms(call)
    finally:
        kernel.early_config_prune = prune
        kernel.cache.clear()
    first = sorted(tuned, key=lambda c: c is not picked)
    return [(c, tuned[c][0] if isinstance(tuned[c], (list, tuple)) else tuned[c], alone[c]) for c in first]


def config_name(c):
    k = c.kwargs
    path = "tma" if k.get("TMA") else "ptr"
    return (f"{path} {k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} s{c.num_stages} w{c.num_warps}"
            + (f" x{k['PER_SM']}/SM" if k.get("TMA") else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16, help="micro-batch B (rows N = B*1024)")
    p.add_argument("--configs", action="store_true", help="also, for each forward and dX product, every "
                   "config the autotuner times: its timing against the product run alone in that config")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/matmul.py: needs a CUDA GPU (it times our kernels against cuBLAS)")
    dev, dt, C, Vp = torch.device("cuda"), torch.bfloat16, 768, 50304
    N = args.batch_size * 1024
    pointer_only = lambda *tensors: False  # noqa: E731
    tma_ready = tk._tma_ready
    rows = []
    for label, rows_, K, M, gelu in (("c_attn", N, C, 3 * C, False), ("attn.c_proj", N, C, C, False),
                                      ("c_fc+gelu", N, C, 4 * C, True), ("mlp.c_proj", N, 4 * C, C, False),
                                      ("lm head", tt.HEAD_ROWS, C, Vp, False)):
        torch.manual_seed(0)
        x = torch.randn(rows_, K, device=dev, dtype=dt)  # (rows, K)
        w = (torch.randn(M, K, device=dev) * K ** -0.5).to(dt)  # (M, K)
        b = torch.randn(M, device=dev, dtype=dt) if label != "lm head" else None  # (M,)
        dy = torch.randn(rows_, M, device=dev, dtype=dt)  # (rows, M)
        ref_y = x.float() @ w.float().t() + (b.float() if b is not None else 0)  # (rows, M) fp32
        ref_dx = dy.float() @ w.float()  # (rows, K)
        ref_dw = dy.float().t() @ x.float()  # (M, K)
        flops = 2 * rows_ * K * M
        if gelu:
            cublas_fwd = lambda: F.gelu(F.linear(x, w, b), approximate="tanh")  # noqa: E731
            ours_fwd = lambda: tk.matmul_gelu_forward(x, w, b)[1]  # noqa: E731 pre-activation checked
        else:
            cublas_fwd = lambda: F.linear(x, w, b)  # noqa: E731
            ours_fwd = lambda: tk.matmul_forward(x, w, b)  # noqa: E731
        dw = torch.zeros(M, K, device=dev)  # (M, K) fp32
        db = torch.zeros(M, device=dev) if b is not None else None
        line = {"op": label, "shape": f"{rows_}x{K}x{M}"}
        line["cublas fwd"] = flops / median_ms(cublas_fwd) / 1e9
        line["cublas dX"] = flops / median_ms(lambda: dy @ w) / 1e9
        line["cublas dW"] = flops / median_ms(lambda: dy.t() @ x) / 1e9
        for name, ready in (("ptr", pointer_only), ("auto", tma_ready)):
            tk._tma_ready = ready
            line[f"{name} fwd"] = flops / median_ms(ours_fwd) / 1e9
            line[f"{name} fwd err"] = rel_err(ours_fwd(), ref_y)
            dx_call = lambda: tk._matmul(dy, w)[0]  # noqa: E731
            line[f"{name} dX"] = flops / median_ms(dx_call) / 1e9
            line[f"{name} dX err"] = rel_err(dx_call(), ref_dx)
        tk._tma_ready = tma_ready
        if args.configs:
            for prod, call in (("fwd", ours_fwd), ("dX", lambda: tk._matmul(dy, w)[0])):
                print(f"configs of {label} {prod}: autotuner ms | alone ms (the autotuner's pick first)")
                for c, tuned_ms, alone_ms in config_rankings(call, tk.matmul_kernel):
                    print(f"  {config_name(c):36s} {tuned_ms:8.4f} {alone_ms:8.4f}", flush=True)
        dw_call = lambda: tk._matmul_dw(dy, x, dw, db)  # noqa: E731
        line["ours dW"] = flops / median_ms(dw_call) / 1e9
        dw.zero_()
        dw_call()
        line["ours dW err"] = rel_err(dw, ref_dw)
        rows.append(line)
        print(line, flush=True)
    print(f"\nTFLOP/s on {torch.cuda.get_device_name()}, N = {N}; err: ||ours - fp32|| / ||fp32|| "
          "(bf16 inputs)")
    print(f"{'op':12s} {'shape':18s} {'product':8s} {'cuBLAS':>7s} {'ptr':>7s} {'auto':>7s} {'best/cuB':>8s} "
          f"{'err':>8s}")
    for r in rows:
        for prod in ("fwd", "dX", "dW"):
            if prod == "dW":
                ours = {"ptr": r["ours dW"], "auto": float("nan")}
                err = r["ours dW err"]
            else:
                ours = {k: r[f"{k} {prod}"] for k in ("ptr", "auto")}
                err = max(r[f"ptr {prod} err"], r[f"auto {prod} err"])
            best = max(v for v in ours.values() if v == v)
            print(f"{r['op']:12s} {r['shape']:18s} {prod:8s} {r[f'cublas {prod}']:7.0f} {ours['ptr']:7.0f} "
                  f"{ours['auto']:7.0f} {best / r[f'cublas {prod}']:8.2f} {err:8.1e}")


if __name__ == "__main__":
    main()
