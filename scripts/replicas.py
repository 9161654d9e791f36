"""N `pagellm serve` replicas behind vllm-router; see pagellm/entrypoints/replicas.py.

    python scripts/replicas.py -dp 2 [--policy cache_aware] --port 8000 -- MODEL [serve flags]
"""

from pagellm.entrypoints.replicas import main

if __name__ == "__main__":
    main()
