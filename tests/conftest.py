"""Make the repository root importable (``import norms``, ``import model``) however pytest is run."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
