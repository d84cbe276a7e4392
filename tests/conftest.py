import os
import sys
import warnings

# Triton kernels run on CPU tensors in Triton's interpreter (must be set before triton is imported)
os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
