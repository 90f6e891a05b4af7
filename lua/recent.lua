-- recent: counts n events as throttled now in a key's recent throttles
-- (common.lua's recent_note), for a caller that throttled them without a
-- booking of its own (throttle.NoteThrottled: a run of tickets in a
-- backlog line given out in one step).
--
-- KEYS[1] -> the key's ring of recent throttles
-- ARGV[1] -> now in µs, or '' to read Redis TIME
-- ARGV[2] -> n, the events throttled
-- Output  -> 1

recent_note(KEYS[1], clock(), tonumber(ARGV[2]))
return 1
