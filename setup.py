"""The compiled core of the SSD tier, the one thing setup.cfg cannot declare (everything else is there).

``hierps.storage._native._core`` is plain C against the buffer protocol: no numpy or PyTorch headers,
so it builds with any C compiler and survives every torch release. It is optional: where it does not
build, hierps runs the same loops in numpy and says so once (``hierps.storage._native``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "hierps.storage._native._core",
            sources=["plugin/hierps/storage/_native/_core.c"],
            extra_compile_args=["-O3", "-std=c11"],
            optional=True,
        )
    ]
)
