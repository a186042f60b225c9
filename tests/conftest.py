import os
import sys

# Tests run on CPU; float64 is enabled per-test where a reference comparison needs it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
