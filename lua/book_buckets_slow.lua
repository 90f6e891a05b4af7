-- book_buckets_slow runs book.lua (book()) on book_buckets.lua's two
-- claims, each {period/g, burst and n in units, limit/g}, with book.lua's
-- KEYS and ARGV: for states the quick steps do not read. Outside
-- book_buckets, so that its quick path does not build this closure.
local function book_buckets_slow(now, start, max_wait, slack, ...)
  local keys, args = {}, {string.format('%d', now), 'book', string.format('%d', start), max_wait, '0', slack, '-1', 0, 2}
  for i, c in ipairs({...}) do
    local aux = KEYS[i] .. ':b'
    for _, k in ipairs({KEYS[i], aux, aux, aux, aux, aux}) do keys[#keys + 1] = k end
    -- limit/g and period/g have no common divisor: new_bucket's units are the same.
    for _, v in ipairs({'token_bucket', c[4], c[1], c[2] / c[1], 1, c[3] / c[1], '', '', '', '', 0, 0, 0, 0}) do
      args[#args + 1] = v
    end
  end
  KEYS, ARGV = keys, args
  return book()
end
