"""Train a LayerNorm-MLP with opfuse from PyTorch, under each recipe, eagerly
and with torch.compile(fullgraph=True); the compiled losses equal the eager
ones bit for bit.

    pip install .            # at the repository root
    python examples/python/train_ln_mlp.py [steps]
"""
import sys

import torch

import opfuse
import opfuse.torch as ot

RECIPES = {"none": None, "mxfp8": opfuse.Recipe.mxfp8(), "fp8 current": opfuse.Recipe.current(),
           "fp8 delayed": opfuse.Recipe.delayed(), "fp8 block": opfuse.Recipe.block(),
           "nvfp4": opfuse.Recipe.nvfp4()}


def model():
    m = ot.Sequential(ot.LayerNorm(64), ot.Linear(64, 256), ot.GELU(), ot.Linear(256, 64))
    with torch.no_grad():  # the same start for every run
        for i, p in enumerate(m.parameters()):
            g = torch.Generator().manual_seed(i)
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (i == 0))
    return m


def train(recipe, compile_it, steps=5, make=model, shape=(64, 64)):
    """Losses of steps SGD steps of a fresh make() on random [shape] inputs."""
    opfuse.default_context().set_rng(1, 0)  # stochastic rounding draws the same numbers
    m = make()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    run = torch.compile(m, fullgraph=True, dynamic=False) if compile_it else m
    g = torch.Generator().manual_seed(42)
    losses = []
    for _ in range(steps):
        x, target = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        with ot.autocast(recipe=recipe):
            loss = (run(x) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(make=model, shape=(64, 64)):
    """Every recipe eagerly and compiled; exits 1 when some compiled run's
    losses differ from the eager ones."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    bad = 0
    for name, recipe in RECIPES.items():
        eager = train(recipe, False, steps, make, shape)
        compiled = train(recipe, True, steps, make, shape)
        same = "same bits" if eager == compiled else "DIFFERENT"
        bad += eager != compiled
        print(f"{name:12s} eager {eager[0]:.5f} -> {eager[-1]:.5f}   compiled: {same}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
