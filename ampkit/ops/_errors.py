"""Exception types shared by the fused ops."""


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (``lr="1e-3"``, ``eps=None``): a TypeError, as torch raises for it, and a
    ValueError, as ampkit raised before, so code catching either keeps working."""


class StateDictKeyError(KeyError):
    """A key a state dict lacks: a KeyError, as torch raises for it, whose message reads as a sentence (KeyError's
    own ``str`` is the quoted ``repr`` of its argument)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
