"""What a traced cuflash.interop.jax call put into its jaxpr, for the trace-time tests."""


def equations(jaxpr, primitive: str):
    """The equations of ``primitive`` in a jaxpr, nested ones (custom_vjp, pjit, scan) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                found += equations(inner, primitive)
    return found


def callbacks(jaxpr):
    """The buffer_callback equations of a jaxpr, nested ones included."""
    return equations(jaxpr, "buffer_callback")
