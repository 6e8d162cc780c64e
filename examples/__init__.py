"""Examples of using gpumem-exporter; not part of the installed package."""
