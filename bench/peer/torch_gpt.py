"""PyTorch peer of `opfuse bench train`: the GPT of `opfuse train` (token and
position embeddings; per block LayerNorm, QKV Linear, causal attention,
projection, residual, LayerNorm, FC1, GELU (tanh), FC2, residual; final
LayerNorm and an output projection tied to the token embedding), trained
with cross-entropy, gradient-norm clipping at 1.0 and AdamW on uniform
random tokens. Prints one line per mode:
    torch_tokens_per_s MODE VALUE        or    torch_failed MODE REASON
CPU modes: eager (fp32), eager-bf16 (bf16 autocast), compile (fp32,
torch.compile). CUDA modes, bf16 autocast with flash attention and fused
AdamW: eager, compile.
Usage: torch_gpt.py DEVICE LAYERS WIDTH HEADS BATCH T VOCAB STEPS THREADS MODE[,MODE...]"""
import sys
import time

import torch
import torch.nn.functional as F

dev, *nums, modes = sys.argv[1:]
layers, width, heads, batch, T, vocab, steps, threads = (int(a) for a in nums)
torch.set_num_threads(threads)
torch.manual_seed(0)
cuda = dev == "cuda"


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(width, eps=1e-5)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width, eps=1e-5)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        B, L, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, heads, C // heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, width)
        self.wpe = torch.nn.Embedding(T, width)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width, eps=1e-5)

    def forward(self, tok, tgt):
        x = self.wte(tok) + self.wpe(torch.arange(tok.shape[1], device=tok.device))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, vocab), tgt.view(-1))


def make_step(mode):
    model = GPT().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.01,
                            **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if mode.startswith("compile") else model
    autocast = cuda or mode.endswith("bf16")
    data = torch.randint(0, vocab, (batch, T + 1), device=dev)
    tok, tgt = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            loss = fwd(tok, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def tokens_per_s(mode):
    step = make_step(mode)
    if cuda:
        sys.path.insert(0, __file__.rsplit("/", 1)[0])
        from peer_timing import median_ms
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            # no preheat: opfuse's side (bench_train.c) warms up by its own
            # steps, as this one does in median_ms's settle
            return batch * T / median_ms(step, preheat_gpu=False) * 1e3
    for _ in range(3):  # warm-up (compiles under torch.compile)
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return batch * T * steps / (time.perf_counter() - t0)


for mode in modes.split(","):
    try:
        print(f"torch_tokens_per_s {mode} {tokens_per_s(mode):.1f}", flush=True)
    except Exception as e:  # a mode this install cannot run (no compiler for Inductor, ...)
        print(f"torch_failed {mode} {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
