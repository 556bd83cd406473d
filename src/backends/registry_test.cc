// The registry and the descriptors it lists: names, lookups, option schemas and the keys
// they refuse, as CLI, C++ and Python read them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "backends/descriptor.h"
#include "wsync/backend.h"
#include "wsync/trainer.h"

namespace wsync {
namespace {

using ::testing::HasSubstr;

TEST(Registry, NamesAreUniqueAndInOrder) {
  std::vector<std::string> names;
  for (const BackendDescriptor* b : Backends()) names.emplace_back(b->name);
  EXPECT_TRUE(std::is_sorted(names.begin(), names.end()));
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()).size(), names.size());
  EXPECT_EQ(names, ReceiverBackendNames());
  EXPECT_EQ(names, TrainerBackendNames());
}

TEST(Registry, TheDefaultBackendIsRegistered) { EXPECT_NE(FindBackend(kDefaultBackend), nullptr); }

TEST(Registry, EveryDescriptorIsComplete) {
  for (const BackendDescriptor* b : Backends()) {
    SCOPED_TRACE(std::string(b->name));
    EXPECT_FALSE(b->summary.empty());
    EXPECT_FALSE(b->init_info_fields.empty());
    EXPECT_TRUE(b->create_receiver);
    EXPECT_NE(b->create_trainer, nullptr);
    EXPECT_EQ(FindBackend(b->name), b);
    std::set<std::string_view> keys;
    for (const BackendOptionSpec& o : b->trainer_options) {
      EXPECT_TRUE(keys.insert(o.key).second) << o.key << " twice";
      EXPECT_FALSE(o.help.empty()) << o.key;
    }
    if (!b->model_option.empty()) EXPECT_TRUE(keys.contains(b->model_option)) << b->model_option;
  }
}

TEST(Registry, UnknownBackendListsTheAvailable) {
  auto r = LookupBackend("carrier-pigeon");
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("unknown backend 'carrier-pigeon': available: "));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(BackendNamesText(", ")));
}

TEST(Registry, TrainerOptionKeysOutsideTheSchemaAreRefused) {
  for (const BackendDescriptor* b : Backends()) {
    SCOPED_TRACE(std::string(b->name));
    TrainerOptions o;
    o.backend = b->name;
    o.servers = {"http://127.0.0.1:1"};
    o.backend_options["no_such_key"] = "1";
    auto made = CreateTrainerEngine(o);
    ASSERT_FALSE(made.ok());
    std::string message(made.status().message());
    EXPECT_THAT(message, HasSubstr("backend '" + std::string(b->name) + "' has no option 'no_such_key'"));
    for (const BackendOptionSpec& spec : b->trainer_options) EXPECT_THAT(message, HasSubstr(std::string(spec.key)));
  }
}

TEST(Registry, ReceiverOptionKeysOutsideTheSchemaAreRefused) {
  for (const BackendDescriptor* b : Backends()) {
    SCOPED_TRACE(std::string(b->name));
    nlohmann::json config = nlohmann::json::object();
    for (const BackendOptionSpec& spec : b->receiver_options) config[std::string(spec.key)] = "x";
    EXPECT_TRUE(CheckReceiverOptionKeys(b->name, config).ok());
    config["no_such_key"] = 1;
    Status s = CheckReceiverOptionKeys(b->name, config);
    EXPECT_THAT(std::string(s.message()), HasSubstr("has no option 'no_such_key'"));
  }
  EXPECT_TRUE(CheckReceiverOptionKeys("carrier-pigeon", {{"anything", 1}}).ok());
}

}  // namespace
}  // namespace wsync
