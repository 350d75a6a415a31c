"""A module no test program imports: its target stays unresolved ("its module was never imported")."""


def never_called() -> None:
    raise AssertionError("not meant to run")
