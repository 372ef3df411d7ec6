"""``apex.amp.lists``: Apex O1's cast tables, one module per patched namespace, in Apex's layout.

Which functions run in low precision (``FP16_FUNCS``), in float32 (``FP32_FUNCS``), in the widest type of their
arguments (``CASTS``, ``SEQUENCE_CASTS``), or are refused in low precision (``BANNED_FUNCS``). Apex's lists are
the spec here, not ``torch.autocast``'s (autocast runs ``sum`` and ``pow`` in the input type, Apex in float32;
autocast leaves ``atan2`` and ``cat`` to torch's type promotion, Apex promotes explicitly and casts in-place
ops to ``self``'s type). Each O1 ``initialize`` reads them afresh, so a script that edits them first gets its
edit, as with Apex: NVIDIA's Tacotron 2 moves ``softmax`` from ``FP32_FUNCS`` to ``FP16_FUNCS``. Names a torch
build lacks are skipped when the casts are installed. ``linalg_overrides`` is ampkit's own: Apex's lists predate
``torch.linalg``.
"""

from ampkit.compat.amp.lists import functional_overrides as functional_overrides
from ampkit.compat.amp.lists import linalg_overrides as linalg_overrides
from ampkit.compat.amp.lists import tensor_overrides as tensor_overrides
from ampkit.compat.amp.lists import torch_overrides as torch_overrides
