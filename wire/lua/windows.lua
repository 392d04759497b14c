-- Heads: admit.lua, count_replay.lua
-- The shared part of the scripts that read a tenant's sliding windows (wire/limits.py):
-- a window is a hash of one-second buckets (unix second -> count) holding the last
-- `window_s` seconds. Defines ``window`` and ``window_wait``; reads no KEYS or ARGV.

-- The live buckets of the window at `key` (those from `oldest` on), oldest first, and
-- their sum; the older buckets are deleted.
local function window(key, oldest)
  local raw = redis.call('HGETALL', key)
  local live, sum = {}, 0
  for i = 1, #raw, 2 do
    local bucket = tonumber(raw[i])
    if bucket < oldest then
      redis.call('HDEL', key, raw[i])
    else
      live[#live + 1] = {bucket, tonumber(raw[i + 1])}
      sum = sum + live[#live][2]
    end
  end
  table.sort(live, function(a, b) return a[1] < b[1] end)
  return live, sum
end

-- Seconds from `now` until `excess` of a window's live buckets have left it.
local function window_wait(live, excess, window_s, now)
  local freed = 0
  for i = 1, #live do
    freed = freed + live[i][2]
    if freed >= excess then return live[i][1] + window_s + 1 - now end
  end
  return window_s + 1
end
