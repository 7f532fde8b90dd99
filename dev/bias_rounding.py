"""How is a 16-bit logit with a bias rounded: once, round(h . w + b), or twice,
round(round(h . w) + b)? Asked of PyTorch's F.linear (its addmm) and of fusedce's logits product
(fusedce.linear_logprobs with keep_logits is not needed: the bias epilogue is cuBLASLt's, the same
call PyTorch makes, so F.linear's answer is printed beside a plain cuBLAS product + bias pass).

  PYTHONPATH=python python3 dev/bias_rounding.py      (on the GPU machine)

Prints, per dtype and shape, the share of logits equal to each rounding model; a model that
matches is at 100% (a float32 accumulation order may flip a few ties)."""

import torch
import torch.nn.functional as F


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for n, h, v in ((37, 19, 300), (133, 72, 1000), (512, 4096, 8192)):
            x = torch.randn(n, h, device="cuda").to(dtype)
            w = (torch.randn(v, h, device="cuda") * 2 / h**0.5).to(dtype)
            b = torch.randn(v, device="cuda").to(dtype)
            exact = x.double() @ w.double().T
            once = (exact + b.double()).float().to(dtype)
            twice = (exact.float().to(dtype).float() + b.float()).to(dtype)
            got = F.linear(x, w, b)
            differ = (once != twice).sum().item()
            print(f"{str(dtype):15s} {n}x{h}x{v}: F.linear == once {100 * (got == once).float().mean().item():.2f}%"
                  f"  == twice {100 * (got == twice).float().mean().item():.2f}%  (the models differ on {differ} logits)")


if __name__ == "__main__":
    main()
