"""The nightly loop around the property suite: its history report and bisection."""
