def register() -> None:
    """Placeholder while the package installs."""
