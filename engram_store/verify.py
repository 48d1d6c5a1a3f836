"""`python -m engram_store.verify DIR`: checks every page of every Engram table file in DIR."""

from engram_store.convert import main_verify

if __name__ == "__main__":
    main_verify()
