"""The probe: the only exporter code a serving process needs to run on every tick.

- record: one device's allocator numbers of one tick in a fixed, versioned binary layout.
- allocator: reads them with the allocator's own C call and packs them, nothing more.

Standard library only (torch is found in sys.modules, never imported): the serving process
imports these before it knows whether it will use CUDA.
"""
