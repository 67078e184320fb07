"""`python -m jax_blockgemm.bench`: runs the benchmark's command line (`cli.main`)."""

from jax_blockgemm.bench.cli import main

if __name__ == "__main__":
    main()
