from flashtree.kv.cache import KVCache, PageTables

__all__ = ["KVCache", "PageTables"]
