"""Exception types shared by the fused ops."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (``lr="1e-3"``, ``eps=None``): a TypeError, as torch raises for it, and a
    ValueError, as ampkit raised before, so code catching either keeps working."""
