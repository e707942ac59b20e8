"""The μGraph search (issue 15; SEARCH.md §6): abstract expressions (``expr``), the
abstract-subexpression oracle that prunes the generator (``oracle``), the reference
program of a captured region (``reference``), and the generator / driver built on them."""
