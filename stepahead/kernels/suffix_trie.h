// SuffixTrie: suffix decoding's depth-bounded counted suffix trie, in compact storage (suffix_trie.cpp).
//
// The same trie, counts, matches and drafts as the Python SuffixTrie in worker/spec_decode/suffix_tree.py,
// which stays as the fallback where this extension cannot be built and as the reference the tests
// check this one against. Nodes live in one vector and are named by their index (the root is 0); a
// frontier is a list of node indices. Children are found through one open-addressing table keyed by
// (parent, token), and each node also links its children in a list, to rescan its most frequent child
// after a count falls. About 65 bytes a node, against some 270 for a node of Python objects.
//
// Not thread-safe: its methods are called with the GIL held (bindings.cpp), one proposer per worker.
#pragma once

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace stepahead_cpu {

class SuffixTrie {
 public:
  using Frontier = std::vector<int32_t>;
  using Tokens = std::vector<int64_t>;
  // (tokens, score: their summed estimated probabilities, match length)
  using Draft = std::tuple<Tokens, double, int64_t>;

  explicit SuffixTrie(int64_t max_depth);

  // Index `tokens` appended to the sequence whose frontier is given (empty: a new sequence); returns
  // the sequence's new frontier (frontier[d - 1]: the node of its last d tokens). O(max_depth) a token.
  Frontier extend(const Frontier& frontier, const Tokens& tokens);
  // Remove a sequence indexed earlier: its substrings' counts drop, nodes left at 0 go.
  void retract(const Tokens& tokens);
  // The frontier of a sequence that is not indexed here, after `tokens`: the nodes of its suffixes
  // found in the trie (lengths 1..m), creating nothing.
  Frontier match(const Frontier& frontier, const Tokens& tokens) const;
  // The matched frontier of the last max_depth tokens, from scratch.
  Frontier match_tokens(const Tokens& tokens) const;
  // The likeliest continuation over every match length (SuffixTrie.draft in suffix_tree.py says how).
  Draft draft(const Frontier& frontier, int64_t max_tokens, double max_spec_factor, double min_token_prob,
              bool open_frontier);

  int64_t count(int32_t node) const;  // occurrences of the node's substring
  // Every indexed substring (the path from the root) with its count, for checks.
  std::vector<std::pair<Tokens, int64_t>> substring_counts() const;
  int64_t num_nodes() const { return num_nodes_; }
  int64_t max_depth() const { return max_depth_; }
  int64_t memory_bytes() const;  // what the trie's storage holds allocated

 private:
  static constexpr int32_t kNone = -1;
  struct Node {
    int32_t count = 0;
    int32_t token = kNone;
    int32_t best = kNone;  // the child with the highest count; kNone: no child, or unknown after a decrement
    int32_t first_child = kNone;
    int32_t next_sibling = kNone;
    int32_t prev_sibling = kNone;
  };
  struct Slot {  // one entry of the child table; child kNone: empty
    int32_t parent = kNone;
    int32_t token = kNone;
    int32_t child = kNone;
  };

  int64_t max_depth_;
  int64_t num_nodes_ = 0;  // without the root
  std::vector<Node> nodes_;
  std::vector<int32_t> free_;  // indices of removed nodes, reused by later additions
  std::vector<Slot> slots_;    // a power of two of them, linear probing
  int64_t used_slots_ = 0;

  // The frontier after `tokens`, each node's child by step(parent, token); a kNone child ends the
  // new frontier at that length (only find gives one: add and remove always have a child).
  template <typename Step>
  Frontier walk(Frontier current, const Tokens& tokens, Step step) const;
  int32_t add(int32_t parent, int32_t token);
  int32_t remove(int32_t parent, int32_t token, std::vector<int32_t>& freed);
  int32_t find(int32_t parent, int32_t token) const;  // the child, or kNone
  int32_t best_child(int32_t node);                   // kNone where the node has no child
  size_t home(int32_t parent, int32_t token) const;
  void insert_slot(int32_t parent, int32_t token, int32_t child);
  void place(const Slot& slot);  // into the first free slot of its probe run (the table has room)
  void erase_slot(int32_t parent, int32_t token);
  void grow();
  void check_frontier(const Frontier& frontier) const;
};

}  // namespace stepahead_cpu
