"""CuTeDSL kernels: the catalog of compiled variants (`catalog`), device helpers shared by every architecture
(`common`), and one package per architecture (`sm90`: Hopper, run on an H200; `sm100`: Blackwell, compiled and
checked only). Importing `catalog` needs nvidia-cutlass-dsl."""
