"""The checkout's pytest configuration: the k3num plugin where no install registered it.

Everything the suite needs (options, fixtures, hypothesis profiles, markers) is the pytest plugin
`k3num.harness.plugin`, which an install of this package registers through its `pytest11` entry
point (`scripts/env.sh` installs the checkout editable, so a plain `pytest` here loads it that way).
In a checkout that was never installed the plugin is loaded from here instead.
"""

from importlib.metadata import entry_points

if not any(ep.name == "k3num" for ep in entry_points(group="pytest11")):
    pytest_plugins = ["k3num.harness.plugin"]
