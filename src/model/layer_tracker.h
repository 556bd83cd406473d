// LayerTracker: which decoder layers of one worker an update has landed whole.
//
// A layer is the parameters whose names share a "model.layers.N" prefix (a parameter
// outside a decoder layer is a layer of its own), restricted to the parameters the
// tracker follows (`tracked`: the fp8 sink's quantized ones, the drafter's own). An
// update touches a layer when any piece of a followed parameter lands in it; a touched
// layer is complete when every piece of every followed parameter it has on this worker
// (fused tensors, stacked experts and replicas included) has landed in the same update.
//
// Not synchronized: used from the worker's thread, like the sink that feeds it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "model/sharding.h"
#include "wsync/status.h"

namespace wsync {

class LayerTracker {
 public:
  // `kind` names the followed tensors in errors ("quantized", "drafter").
  LayerTracker(const ShardingTable& table, const std::function<bool(int param)>& tracked, std::string kind);

  // Marks the pieces of every followed parameter that HF tensor `hf_name` fills / one
  // piece. Indices outside the table and pieces of parameters not followed are ignored.
  void MarkHf(std::string_view hf_name);
  void MarkPiece(int param, int piece);
  // The layers complete since the last call (each returned once per update), as their
  // followed parameter indices.
  std::vector<int> TakeCompleted();
  // OK when every touched layer is complete; otherwise FailedPrecondition naming each
  // incomplete layer, e.g. "tp rank 0: 1 layer(s) touched by this update did not land
  // every quantized tensor: model.layers.3: 1 of 7 quantized tensors incomplete
  // (mlp.up_proj.weight)" (HF tensors with a piece on this worker that did not land).
  Status CheckComplete() const;
  // Layers an update touched and completed / touched at all, since the last Reset.
  size_t completed_layers() const;
  size_t touched_layers() const { return dirty_.size(); }
  // Forgets every mark (a new update).
  void Reset();

  size_t num_layers() const { return layers_.size(); }
  const std::string& layer_name(size_t i) const { return layers_[i].name; }

 private:
  struct Layer {
    std::string name;         // "model.layers.3"
    std::vector<int> params;  // followed parameter indices
    size_t pieces = 0;        // pieces of those parameters on this worker
    size_t landed = 0;        // distinct pieces marked this update
    bool taken = false;       // returned by TakeCompleted this update
  };
  const ShardingTable& table_;
  std::string kind_;
  std::vector<Layer> layers_;
  std::vector<int> layer_of_;                 // per param: index in layers_, or -1
  std::vector<std::vector<uint8_t>> landed_;  // per param, per piece
  std::vector<size_t> dirty_;                 // layers touched this update
};

}  // namespace wsync
