package throttle

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
