// SuffixTrie (suffix_trie.h): the Python SuffixTrie's walks (worker/spec_decode/suffix_tree.py) over nodes
// named by index. The Python trie stays as the fallback where this extension cannot be built and as the
// reference tests/worker/spec_decode/test_suffix_tree.py checks this one against, with brute force.

#include "suffix_trie.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace stepahead_cpu {

namespace {

constexpr int32_t kMaxIndex = std::numeric_limits<int32_t>::max();

void check_tokens(const SuffixTrie::Tokens& tokens) {
  for (const int64_t token : tokens) {
    if (token < 0 || token > kMaxIndex) {
      throw std::invalid_argument("suffix trie: token ids must be in [0, 2**31), got " + std::to_string(token));
    }
  }
}

}  // namespace

SuffixTrie::SuffixTrie(int64_t max_depth) : max_depth_(max_depth), nodes_(1), slots_(16) {
  if (max_depth < 1) {
    throw std::invalid_argument("suffix trie max_depth must be >= 1, got " + std::to_string(max_depth));
  }
}

template <typename Step>
SuffixTrie::Frontier SuffixTrie::walk(Frontier current, const Tokens& tokens, Step step) const {
  Frontier next;
  next.reserve(max_depth_);
  for (const int64_t token : tokens) {
    next.clear();
    const int32_t first = step(0, static_cast<int32_t>(token));
    if (first != kNone) {
      next.push_back(first);
      const size_t keep = std::min<size_t>(current.size(), max_depth_ - 1);
      for (size_t i = 0; i < keep; ++i) {
        const int32_t child = step(current[i], static_cast<int32_t>(token));
        if (child == kNone) break;
        next.push_back(child);
      }
    }
    std::swap(current, next);
  }
  return current;
}

SuffixTrie::Frontier SuffixTrie::extend(const Frontier& frontier, const Tokens& tokens) {
  check_frontier(frontier);
  check_tokens(tokens);
  return walk(frontier, tokens, [this](int32_t parent, int32_t token) { return add(parent, token); });
}

void SuffixTrie::retract(const Tokens& tokens) {
  check_tokens(tokens);
  // A node left at 0 keeps its links until the walk ends: the frontier may still step through it to
  // its own children (their counts fall to 0 in the same walk), so it is reused only afterwards.
  std::vector<int32_t> freed;
  walk({}, tokens, [this, &freed](int32_t parent, int32_t token) { return remove(parent, token, freed); });
  free_.insert(free_.end(), freed.begin(), freed.end());
}

SuffixTrie::Frontier SuffixTrie::match(const Frontier& frontier, const Tokens& tokens) const {
  check_frontier(frontier);
  check_tokens(tokens);
  // A suffix not in the trie ends the frontier there: no longer suffix can be in it either.
  return walk(frontier, tokens, [this](int32_t parent, int32_t token) { return find(parent, token); });
}

SuffixTrie::Frontier SuffixTrie::match_tokens(const Tokens& tokens) const {
  const size_t start = tokens.size() > static_cast<size_t>(max_depth_) ? tokens.size() - max_depth_ : 0;
  return match({}, Tokens(tokens.begin() + start, tokens.end()));
}

SuffixTrie::Draft SuffixTrie::draft(const Frontier& frontier, int64_t max_tokens, double max_spec_factor,
                                    double min_token_prob, bool open_frontier) {
  check_frontier(frontier);
  const int64_t matched = static_cast<int64_t>(frontier.size());
  Draft best{Tokens{}, 0.0, 0};
  for (int64_t length = matched; length >= 1; --length) {
    // A draft scores at most its length; this cap only shrinks as the match does (the depth's grows).
    const int64_t cap = static_cast<int64_t>(
        std::min(static_cast<double>(max_tokens), max_spec_factor * static_cast<double>(length)));
    if (static_cast<double>(cap) <= std::get<1>(best)) break;
    const int64_t budget = std::min(cap, max_depth_ - length);
    int32_t node = frontier[length - 1];
    Tokens tokens;
    double prob = 1.0, score = 0.0;
    int64_t depth = length;
    while (static_cast<int64_t>(tokens.size()) < budget) {
      const int32_t child = best_child(node);
      if (child == kNone) break;
      // The frontier's own node counts the sequence's end, which has no continuation yet.
      const bool open_end = open_frontier && depth <= matched && frontier[depth - 1] == node;
      const int64_t total = static_cast<int64_t>(nodes_[node].count) - (open_end ? 1 : 0);
      if (total <= 0) break;
      prob *= static_cast<double>(nodes_[child].count) / static_cast<double>(total);
      if (prob < min_token_prob) break;
      tokens.push_back(nodes_[child].token);
      score += prob;
      node = child;
      ++depth;
    }
    if (score > std::get<1>(best)) best = Draft{std::move(tokens), score, length};
  }
  return best;
}

int64_t SuffixTrie::count(int32_t node) const {
  check_frontier({node});
  return nodes_[node].count;
}

std::vector<std::pair<SuffixTrie::Tokens, int64_t>> SuffixTrie::substring_counts() const {
  std::vector<std::pair<Tokens, int64_t>> out;
  std::vector<std::pair<int32_t, Tokens>> stack{{0, Tokens{}}};
  while (!stack.empty()) {
    auto [node, path] = std::move(stack.back());
    stack.pop_back();
    for (int32_t child = nodes_[node].first_child; child != kNone; child = nodes_[child].next_sibling) {
      Tokens longer = path;
      longer.push_back(nodes_[child].token);
      out.emplace_back(longer, nodes_[child].count);
      stack.emplace_back(child, std::move(longer));
    }
  }
  return out;
}

int64_t SuffixTrie::memory_bytes() const {
  return static_cast<int64_t>(nodes_.capacity() * sizeof(Node) + free_.capacity() * sizeof(int32_t) +
                              slots_.capacity() * sizeof(Slot));
}

int32_t SuffixTrie::add(int32_t parent, int32_t token) {
  int32_t child = find(parent, token);
  if (child == kNone) {
    if (!free_.empty()) {
      child = free_.back();
      free_.pop_back();
    } else {
      if (nodes_.size() > static_cast<size_t>(kMaxIndex)) throw std::length_error("suffix trie: 2**31 nodes");
      child = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    }
    Node& fresh = nodes_[child];
    fresh = Node{};
    fresh.token = token;
    fresh.next_sibling = nodes_[parent].first_child;
    if (fresh.next_sibling != kNone) nodes_[fresh.next_sibling].prev_sibling = child;
    nodes_[parent].first_child = child;
    insert_slot(parent, token, child);
    ++num_nodes_;
  }
  Node& node = nodes_[child];
  if (node.count == kMaxIndex) throw std::overflow_error("suffix trie: a count reached 2**31");
  ++node.count;
  Node& up = nodes_[parent];
  if (up.best == kNone) {
    if (up.first_child == child && node.next_sibling == kNone) up.best = child;  // else rescanned when needed
  } else if (up.best != child) {
    const Node& best = nodes_[up.best];
    if (node.count > best.count || (node.count == best.count && node.token < best.token)) up.best = child;
  }
  return child;
}

int32_t SuffixTrie::remove(int32_t parent, int32_t token, std::vector<int32_t>& freed) {
  const int32_t child = find(parent, token);
  if (child == kNone) throw std::logic_error("suffix trie: retracting a sequence that was not indexed");
  Node& node = nodes_[child];
  --node.count;
  Node& up = nodes_[parent];
  if (up.best == child) up.best = kNone;  // rescanned when next needed
  if (node.count == 0) {
    if (node.prev_sibling != kNone) {
      nodes_[node.prev_sibling].next_sibling = node.next_sibling;
    } else {
      up.first_child = node.next_sibling;
    }
    if (node.next_sibling != kNone) nodes_[node.next_sibling].prev_sibling = node.prev_sibling;
    erase_slot(parent, token);
    --num_nodes_;
    freed.push_back(child);
  }
  return child;
}

int32_t SuffixTrie::best_child(int32_t node) {
  Node& up = nodes_[node];
  if (up.best == kNone && up.first_child != kNone) {  // the most frequent child, the smallest id among equals
    int32_t best = up.first_child;
    for (int32_t child = nodes_[best].next_sibling; child != kNone; child = nodes_[child].next_sibling) {
      const Node &candidate = nodes_[child], &leader = nodes_[best];
      if (candidate.count > leader.count || (candidate.count == leader.count && candidate.token < leader.token)) {
        best = child;
      }
    }
    up.best = best;
  }
  return up.best;
}

size_t SuffixTrie::home(int32_t parent, int32_t token) const {
  // Fibonacci hashing: the product's high bits, as many as the table has.
  const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) | static_cast<uint32_t>(token);
  const int shift = 64 - __builtin_ctzll(slots_.size());
  return static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> shift);
}

int32_t SuffixTrie::find(int32_t parent, int32_t token) const {
  const size_t mask = slots_.size() - 1;
  for (size_t i = home(parent, token);; i = (i + 1) & mask) {
    const Slot& slot = slots_[i];
    if (slot.child == kNone) return kNone;
    if (slot.parent == parent && slot.token == token) return slot.child;
  }
}

void SuffixTrie::insert_slot(int32_t parent, int32_t token, int32_t child) {
  if ((used_slots_ + 1) * 10 > static_cast<int64_t>(slots_.size()) * 7) grow();
  place(Slot{parent, token, child});
  ++used_slots_;
}

void SuffixTrie::place(const Slot& slot) {
  const size_t mask = slots_.size() - 1;
  size_t i = home(slot.parent, slot.token);
  while (slots_[i].child != kNone) i = (i + 1) & mask;
  slots_[i] = slot;
}

void SuffixTrie::erase_slot(int32_t parent, int32_t token) {
  // Backward-shift deletion: later entries of the probe run move up, so no tombstones build up.
  const size_t mask = slots_.size() - 1;
  size_t hole = home(parent, token);
  while (!(slots_[hole].parent == parent && slots_[hole].token == token)) hole = (hole + 1) & mask;
  for (size_t j = (hole + 1) & mask; slots_[j].child != kNone; j = (j + 1) & mask) {
    const size_t want = home(slots_[j].parent, slots_[j].token);
    // The entry at j stays where it is if its home lies cyclically in (hole, j].
    const bool stays = hole <= j ? (hole < want && want <= j) : (hole < want || want <= j);
    if (!stays) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = Slot{};
  --used_slots_;
}

void SuffixTrie::grow() {
  std::vector<Slot> old(slots_.size() * 2);
  std::swap(old, slots_);
  for (const Slot& slot : old) {
    if (slot.child != kNone) place(slot);
  }
}

void SuffixTrie::check_frontier(const Frontier& frontier) const {
  if (static_cast<int64_t>(frontier.size()) > max_depth_) {
    throw std::invalid_argument("suffix trie frontier: " + std::to_string(frontier.size()) +
                                " nodes, more than max_depth " + std::to_string(max_depth_));
  }
  for (const int32_t node : frontier) {
    if (node <= 0 || static_cast<size_t>(node) >= nodes_.size() || nodes_[node].count <= 0) {
      throw std::invalid_argument("suffix trie frontier: node " + std::to_string(node) +
                                  " is not a live node of this trie (a frontier of another trie, or taken "
                                  "before nodes were removed)");
    }
  }
}

}  // namespace stepahead_cpu
