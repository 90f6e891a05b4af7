package throttle

import "strings"

// slotOf is the Redis Cluster slot of a key whose hash tag is tag: CRC16
// (XMODEM) of the tag, modulo 16384, as the cluster specification defines
// it. Book uses it to tell which claims one script can decide together.
func slotOf(tag string) int {
	crc := uint16(0)
	for i := 0; i < len(tag); i++ {
		crc ^= uint16(tag[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

// keySlot is the Redis Cluster slot of the Redis key key: of its hash tag,
// the bytes between its first '{' and the next '}' if there are any, else
// of the whole key.
func keySlot(key string) int {
	if open := strings.IndexByte(key, '{'); open >= 0 {
		if n := strings.IndexByte(key[open+1:], '}'); n > 0 {
			return slotOf(key[open+1 : open+1+n])
		}
	}
	return slotOf(key)
}

// Slot is the Redis Cluster slot of the keys whose hash tag is tag (as
// Key builds them, when tag needs no escape): for a program that places
// its own keys, as package producer names a sharded queue's shards.
func Slot(tag string) int { return slotOf(tag) }
