"""The optional compiled part of remotorch: the framing's hot path (src/remotorch/transport/_cframing.c).

Everything else is in pyproject.toml. The extension links OpenSSL's libcrypto;
where it cannot be built (no compiler, no headers) the install goes on without
it and remotorch uses the pure-Python framing, which speaks the same bytes.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("remotorch.transport._cframing", ["src/remotorch/transport/_cframing.c"],
                             libraries=["crypto"], extra_compile_args=["-O2", "-std=gnu11"], optional=True)])
