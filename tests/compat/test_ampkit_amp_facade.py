"""``ampkit.amp.initialize`` & co. reach the Apex API without the engine importing compat."""

import subprocess
import sys
from pathlib import Path

import pytest

import ampkit.amp
import ampkit.compat.amp

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["initialize", "scale_loss", "state_dict", "load_state_dict", "_amp_state"])
def test_apex_names_on_the_engine_package_are_the_compat_objects(name):
    assert getattr(ampkit.amp, name) is getattr(ampkit.compat.amp, name)


def test_importing_the_engine_does_not_import_compat():
    code = "import sys, ampkit.amp; assert not any(m.startswith('ampkit.compat') for m in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_unknown_names_still_raise():
    with pytest.raises(AttributeError, match="no_such_name"):
        ampkit.amp.no_such_name  # noqa: B018
