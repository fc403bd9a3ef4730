"""Conformance runner: the peers' own jit tests with fastcall patched in (see runner.py).

Run ``python -m tests.conformance --help`` from the repository root. Nothing in this
package is collected by the normal ``python -m pytest`` run.
"""
