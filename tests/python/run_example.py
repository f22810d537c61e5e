"""Runs one example of examples/python for ctest: skipped (exit 77, said
why) where PyTorch is not installed, as in `make test`'s venv (`make bench`
installs it)."""
import importlib.util
import os
import runpy
import sys

if importlib.util.find_spec("torch") is None:
    print("run_example: PyTorch is not installed in this Python (make bench installs it): skipped")
    sys.exit(77)
path = sys.argv[1]
sys.path.insert(0, os.path.dirname(path))
sys.argv = sys.argv[1:]
runpy.run_path(path, run_name="__main__")
