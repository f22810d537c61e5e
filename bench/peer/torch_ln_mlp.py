"""PyTorch CPU peer of `opfuse bench ops`: the same residual LayerNorm-MLP
training step (fp32, AdamW), timed the same way. Prints one line:
    torch_ms_per_step <ms> threads <n>
Usage: torch_ln_mlp.py TOKENS HIDDEN FFN STEPS THREADS"""
import sys
import time

import torch

tokens, hidden, ffn, steps, threads = (int(a) for a in sys.argv[1:6])
torch.set_num_threads(threads)
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(hidden, eps=1e-5)
        self.fc1 = torch.nn.Linear(hidden, ffn)
        self.fc2 = torch.nn.Linear(ffn, hidden)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x)), approximate="tanh"))


model = Block()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
x = torch.randn(tokens, hidden)
t = torch.randn(tokens, hidden)
times = []
for step in range(steps + 1):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    y = model(x)
    loss = torch.nn.functional.mse_loss(y, t)
    loss.backward()
    opt.step()
    if step:
        times.append(time.perf_counter() - t0)
times.sort()
print(f"torch_ms_per_step {times[len(times) // 2] * 1e3:.4f} threads {threads}")
