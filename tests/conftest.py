import os

# One torch thread per process: on this 2-core machine two threads beside any other busy
# process are ~10x slower (measured on the 2-core CI machine).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
