"""Child processes of ``python -m ampkit.legacy``: resolve ``import apex`` (and Apex's extension modules) to
ampkit, as in the parent.

Active only when ``AMPKIT_APEX_SHIM`` is set (the launcher sets it after installing the shim). Nothing of
ampkit is imported until the first ``import apex`` or of an extension module the shim serves (or a lookup of
apex's distribution); then the real shim is installed and answers. The environment's own ``sitecustomize``
(shadowed by this one) is run afterwards.
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
# Apex's top-level extension modules that the shim serves (its _TOP_LEVEL_MODULES), spelt out so that nothing of
# ampkit loads before one is asked for: a worker may load one by name before anything imports apex.
EXTENSION_MODULES = (
    "amp_C",
    "apex_C",
    "fused_adam_cuda",
    "fused_layer_norm_cuda",
    "fused_mix_prec_layer_norm_cuda",
    "focal_loss_cuda",
    "xentropy_cuda",
    "fused_weight_gradient_mlp_cuda",
    "scaled_upper_triang_masked_softmax_cuda",
    "scaled_masked_softmax_cuda",
    "generic_scaled_masked_softmax_cuda",
    "scaled_softmax_cuda",
)


class _InstallShimOnFirstApexImport:
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "apex" and fullname not in EXTENSION_MODULES and not fullname.startswith("apex."):
            return None
        return self._install().find_spec(fullname, path, target)

    def find_distributions(self, context=None):
        """``importlib.metadata.version("apex")`` before any ``import apex`` installs the shim too."""
        name = getattr(context, "name", None)
        if name is None or name.lower().replace("-", "_").replace(".", "_") != "apex":
            return []
        return self._install().find_distributions(context)

    def _install(self):
        sys.meta_path.remove(self)
        from ampkit.compat.shim import _installed_finder, install_apex_shim

        install_apex_shim(force=True)  # the parent already decided that the shim wins
        return _installed_finder()


def _run_shadowed_sitecustomize():
    for entry in sys.path:
        if os.path.abspath(entry or os.curdir) == _HERE:
            continue
        candidate = os.path.join(entry or os.curdir, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", candidate)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


if os.environ.get("AMPKIT_APEX_SHIM"):
    sys.meta_path.insert(0, _InstallShimOnFirstApexImport())
_run_shadowed_sitecustomize()
