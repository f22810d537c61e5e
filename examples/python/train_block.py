"""Train a small pre-norm transformer block (attention and MLP, each with a
residual) with opfuse from PyTorch, under each recipe, eagerly and with
torch.compile(fullgraph=True); the compiled losses equal the eager ones bit
for bit. The whole block is one opfuse.torch.Sequential: the residuals are
channels (MakeExtraOutput -> AddExtraInput), and the fuser picks its
forward and backward fusions (linear + bias + GELU, linear + bias + add,
the backward linear + add) independently.

    pip install .            # at the repository root
    python examples/python/train_block.py [steps]
"""
import torch

import opfuse.torch as ot
from train_ln_mlp import main  # its training loop and recipes

B, T, C, HEADS = 2, 64, 64, 4


def block():
    m = ot.Sequential(
        ot.MakeExtraOutput("attn_in", in_place=True), ot.LayerNorm(C), ot.Linear(C, 3 * C),
        ot.Attention(HEADS), ot.Linear(C, C), ot.AddExtraInput("attn_in", in_place=True),
        ot.MakeExtraOutput("mlp_in", in_place=True), ot.LayerNorm(C), ot.Linear(C, 4 * C),
        ot.GELU(), ot.Linear(4 * C, C), ot.AddExtraInput("mlp_in", in_place=True))
    with torch.no_grad():  # the same start for every run
        for i, (name, p) in enumerate(m.named_parameters()):
            g = torch.Generator().manual_seed(i)
            norm_weight = p.dim() == 1 and "weight" in name
            p.copy_(torch.randn(p.shape, generator=g) * 0.05 + norm_weight)
    return m


if __name__ == "__main__":
    main(block, (B, T, C))  # the loop of train_ln_mlp.py, on [B, T, C] inputs
