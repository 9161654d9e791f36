"""N `pagellm serve` replicas behind one least-loaded proxy; see pagellm/entrypoints/replicas.py.

    python scripts/replicas.py --data-parallel-size 2 --port 8000 -- MODEL [pagellm serve flags]
"""

from pagellm.entrypoints.replicas import main

if __name__ == "__main__":
    main()
