import sysconfig

from setuptools import setup

# Metadata lives in pyproject.toml; this file wires the cffi extension.  cffi
# builds it against the stable ABI, so a wheel is tagged abi3 and serves every
# CPython >= 3.9 (free-threaded builds have no stable ABI: they build their own).
options = {}
if not sysconfig.get_config_var("Py_GIL_DISABLED"):
    options["bdist_wheel"] = {"py_limited_api": "cp39"}

setup(cffi_modules=["csrc/build_ffi.py:ffibuilder"], options=options)
