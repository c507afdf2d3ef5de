"""ringpass's version, written into each artifact and compared at load (a module of its own, so the modules that
read it need not import the `ringpass` package that imports them)."""

__version__ = "0.1.0"
