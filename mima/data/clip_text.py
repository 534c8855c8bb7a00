"""Class names and prompt templates of the CLIP merging benchmark (for the tasks' zero-shot heads).

The templates are CLIP's (openai/CLIP, data/prompts.md), as task_vectors and tall_masks use them.
Class names are listed in label order, i.e. in the order of the label indices that the loaders in
`mima.data.clip_tasks` produce. Where task_vectors derives names from folder names (DTD, SUN397,
RESISC45, EuroSAT) the same rule is applied here, so a head built by mima matches theirs.
"""

from __future__ import annotations

# ------------------------------------------------------------------------------------- templates
_PHOTO_OF_A = ("a photo of a {}.", "a photo of the {}.")
_CIFAR = (
    "a photo of a {}.",
    "a blurry photo of a {}.",
    "a black and white photo of a {}.",
    "a low contrast photo of a {}.",
    "a high contrast photo of a {}.",
    "a bad photo of a {}.",
    "a good photo of a {}.",
    "a photo of a small {}.",
    "a photo of a big {}.",
    "a photo of the {}.",
    "a blurry photo of the {}.",
    "a black and white photo of the {}.",
    "a low contrast photo of the {}.",
    "a high contrast photo of the {}.",
    "a bad photo of the {}.",
    "a good photo of the {}.",
    "a photo of the small {}.",
    "a photo of the big {}.",
)
_NUMBER = ('a photo of the number: "{}".',)

TEMPLATES: dict[str, tuple[str, ...]] = {
    "Cars": (
        "a photo of a {}.",
        "a photo of the {}.",
        "a photo of my {}.",
        "i love my {}!",
        "a photo of my dirty {}.",
        "a photo of my clean {}.",
        "a photo of my new {}.",
        "a photo of my old {}.",
    ),
    "DTD": tuple(f"a photo of {article} {{}} {noun}." for article in ("a", "the")
                 for noun in ("texture", "pattern", "thing", "object")),
    "EuroSAT": (
        "a centered satellite photo of {}.",
        "a centered satellite photo of a {}.",
        "a centered satellite photo of the {}.",
    ),
    "GTSRB": (
        'a zoomed in photo of a "{}" traffic sign.',
        'a centered photo of a "{}" traffic sign.',
        'a close up photo of a "{}" traffic sign.',
    ),
    "MNIST": _NUMBER,
    "RESISC45": tuple(f"{kind} {{}}." if article == "" else f"{kind} {article} {{}}."
                      for article in ("", "a", "the")
                      for kind in ("satellite imagery of", "aerial imagery of", "satellite photo of",
                                   "aerial photo of", "satellite view of", "aerial view of")),
    "SUN397": _PHOTO_OF_A,
    "SVHN": _NUMBER,
    "CIFAR10": _CIFAR,
    "CIFAR100": _CIFAR,
    "STL10": _PHOTO_OF_A,
    "OxfordIIITPet": ("a photo of a {}, a type of pet.",),
    "Flowers102": ("a photo of a {}, a type of flower.",),
    "PCAM": ("this is a photo of {}",),
    "FER2013": (
        "a photo of a {} looking face.",
        "a photo of a face showing the emotion: {}.",
        "a photo of a face looking {}.",
        "a face that looks {}.",
        "they look {}.",
        "look at how {} they are.",
    ),
    "Food101": ("a photo of {}, a type of food.",),
    "FashionMNIST": _PHOTO_OF_A,
    "RenderedSST2": ("a {} review of a movie.",),
    "EMNIST": ('a photo of the digit character: "{}".',),
    "KMNIST": ("a photo of the character {}.",),
}

# ----------------------------------------------------------------------------------- class names
DIGITS = tuple(str(d) for d in range(10))

CIFAR10 = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

CIFAR100 = tuple(
    """
apple|aquarium fish|baby|bear|beaver|bed|bee|beetle|bicycle|bottle|bowl|boy|bridge|bus|butterfly|camel|can|castle|
caterpillar|cattle|chair|chimpanzee|clock|cloud|cockroach|couch|crab|crocodile|cup|dinosaur|dolphin|elephant|
flatfish|forest|fox|girl|hamster|house|kangaroo|keyboard|lamp|lawn mower|leopard|lion|lizard|lobster|man|maple tree|
motorcycle|mountain|mouse|mushroom|oak tree|orange|orchid|otter|palm tree|pear|pickup truck|pine tree|plain|plate|
poppy|porcupine|possum|rabbit|raccoon|ray|road|rocket|rose|sea|seal|shark|shrew|skunk|skyscraper|snail|snake|spider|
squirrel|streetcar|sunflower|sweet pepper|table|tank|telephone|television|tiger|tractor|train|trout|tulip|turtle|
wardrobe|whale|willow tree|wolf|woman|worm""".replace("\n", "").split("|")
)

STL10 = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship", "truck")

# DTD class folder names (sorted, as the folders are read); the class names are the same words.
DTD = tuple(
    """banded blotchy braided bubbly bumpy chequered cobwebbed cracked crosshatched crystalline dotted fibrous
    flecked freckled frilly gauzy grid grooved honeycombed interlaced knitted lacelike lined marbled matted meshed
    paisley perforated pitted pleated polka-dotted porous potholed scaly smeared spiralled sprinkled stained
    stratified striped studded swirly veined waffled woven wrinkled zigzagged""".split()
)

# EuroSAT class folder -> the class name CLIP and task_vectors use (in sorted folder order).
EUROSAT_FOLDERS = {
    "AnnualCrop": "annual crop land",
    "Forest": "forest",
    "HerbaceousVegetation": "brushland or shrubland",
    "Highway": "highway or road",
    "Industrial": "industrial buildings or commercial buildings",
    "Pasture": "pasture land",
    "PermanentCrop": "permanent crop land",
    "Residential": "residential buildings or homes or apartments",
    "River": "river",
    "SeaLake": "lake or sea",
}

# RESISC45 class folder names (NWPU-RESISC45/<folder>/); class names replace "_" by a space.
RESISC45_FOLDERS = tuple(
    """airplane airport baseball_diamond basketball_court beach bridge chaparral church circular_farmland cloud
    commercial_area dense_residential desert forest freeway golf_course ground_track_field harbor industrial_area
    intersection island lake meadow medium_residential mobile_home_park mountain overpass palace parking_lot railway
    railway_station rectangular_farmland river roundabout runway sea_ice ship snowberg sparse_residential stadium
    storage_tank tennis_court terrace thermal_power_station wetland""".split()
)

# The 397 SUN397 categories, as in the dataset's ClassName.txt without the leading "/<letter>/".
# The task_vectors layout puts each in a folder "<letter>_<category with '/' replaced by '_'>".
SUN397_CATEGORIES = tuple(
    """abbey airplane_cabin airport_terminal alley amphitheater amusement_arcade amusement_park anechoic_chamber
    apartment_building/outdoor apse/indoor aquarium aqueduct arch archive arrival_gate/outdoor art_gallery art_school
    art_studio assembly_line athletic_field/outdoor atrium/public attic auditorium auto_factory
    badlands badminton_court/indoor baggage_claim bakery/shop balcony/exterior balcony/interior ball_pit ballroom
    bamboo_forest banquet_hall bar barn barndoor baseball_field basement basilica basketball_court/outdoor bathroom
    batters_box bayou bazaar/indoor bazaar/outdoor beach beauty_salon bedroom berth biology_laboratory bistro/indoor
    boardwalk boat_deck boathouse bookstore booth/indoor botanical_garden bow_window/indoor bow_window/outdoor
    bowling_alley boxing_ring brewery/indoor bridge building_facade bullring burial_chamber bus_interior butchers_shop
    butte
    cabin/outdoor cafeteria campsite campus canal/natural canal/urban candy_store canyon car_interior/backseat
    car_interior/frontseat carrousel casino/indoor castle catacomb cathedral/indoor cathedral/outdoor cavern/indoor
    cemetery chalet cheese_factory chemistry_lab chicken_coop/indoor chicken_coop/outdoor childs_room church/indoor
    church/outdoor classroom clean_room cliff cloister/indoor closet clothing_store coast cockpit coffee_shop
    computer_room conference_center conference_room construction_site control_room control_tower/outdoor corn_field
    corral corridor cottage_garden courthouse courtroom courtyard covered_bridge/exterior creek crevasse crosswalk
    cubicle/office
    dam delicatessen dentists_office desert/sand desert/vegetation diner/indoor diner/outdoor dinette/home
    dinette/vehicle dining_car dining_room discotheque dock doorway/outdoor dorm_room driveway driving_range/outdoor
    drugstore
    electrical_substation elevator/door elevator/interior elevator_shaft engine_room escalator/indoor excavation
    factory/indoor fairway fastfood_restaurant field/cultivated field/wild fire_escape fire_station
    firing_range/indoor fishpond florist_shop/indoor food_court forest/broadleaf forest/needleleaf forest_path
    forest_road formal_garden fountain
    galley game_room garage/indoor garbage_dump gas_station gazebo/exterior general_store/indoor
    general_store/outdoor gift_shop golf_course greenhouse/indoor greenhouse/outdoor gymnasium/indoor
    hangar/indoor hangar/outdoor harbor hayfield heliport herb_garden highway hill home_office hospital hospital_room
    hot_spring hot_tub/outdoor hotel/outdoor hotel_room house hunting_lodge/outdoor
    ice_cream_parlor ice_floe ice_shelf ice_skating_rink/indoor ice_skating_rink/outdoor iceberg igloo
    industrial_area inn/outdoor islet
    jacuzzi/indoor jail/indoor jail_cell jewelry_shop
    kasbah kennel/indoor kennel/outdoor kindergarden_classroom kitchen kitchenette
    labyrinth/outdoor lake/natural landfill landing_deck laundromat lecture_room library/indoor library/outdoor
    lido_deck/outdoor lift_bridge lighthouse limousine_interior living_room lobby lock_chamber locker_room
    mansion manufactured_home market/indoor market/outdoor marsh martial_arts_gym mausoleum medina moat/water
    monastery/outdoor mosque/indoor mosque/outdoor motel mountain mountain_snowy movie_theater/indoor museum/indoor
    music_store music_studio
    nuclear_power_plant/outdoor nursery
    oast_house observatory/outdoor ocean office office_building oil_refinery/outdoor oilrig operating_room orchard
    outhouse/outdoor
    pagoda palace pantry park parking_garage/indoor parking_garage/outdoor parking_lot parlor pasture patio pavilion
    pharmacy phone_booth physics_laboratory picnic_area pilothouse/indoor planetarium/outdoor playground playroom
    plaza podium/indoor podium/outdoor pond poolroom/establishment poolroom/home power_plant/outdoor promenade_deck
    pub/indoor pulpit putting_green
    racecourse raceway raft railroad_track rainforest reception recreation_room residential_neighborhood restaurant
    restaurant_kitchen restaurant_patio rice_paddy riding_arena river rock_arch rope_bridge ruin runway
    sandbar sandbox sauna schoolhouse sea_cliff server_room shed shoe_shop shopfront shopping_mall/indoor shower
    skatepark ski_lodge ski_resort ski_slope sky skyscraper slum snowfield squash_court stable stadium/baseball
    stadium/football stage/indoor staircase street subway_interior subway_station/platform supermarket sushi_bar
    swamp swimming_pool/indoor swimming_pool/outdoor synagogue/indoor synagogue/outdoor
    television_studio temple/east_asia temple/south_asia tennis_court/indoor tennis_court/outdoor tent/outdoor
    theater/indoor_procenium theater/indoor_seats thriftshop throne_room ticket_booth toll_plaza topiary_garden tower
    toyshop track/outdoor train_railway train_station/platform tree_farm tree_house trench
    underwater/coral_reef utility_room
    valley van_interior vegetable_garden veranda veterinarians_office viaduct videostore village vineyard volcano
    volleyball_court/indoor volleyball_court/outdoor
    waiting_room warehouse/indoor water_tower waterfall/block waterfall/fan waterfall/plunge watering_hole wave
    wet_bar wheat_field wind_farm windmill wine_cellar/barrel_storage wine_cellar/bottle_storage
    wrestling_ring/indoor
    yard youth_hostel""".split()
)

# GTSRB classes 0-42, CLIP's descriptions of the signs.
GTSRB = tuple(
    """red and white circle 20 kph speed limit
red and white circle 30 kph speed limit
red and white circle 50 kph speed limit
red and white circle 60 kph speed limit
red and white circle 70 kph speed limit
red and white circle 80 kph speed limit
end / de-restriction of 80 kph speed limit
red and white circle 100 kph speed limit
red and white circle 120 kph speed limit
red and white circle red car and black car no passing
red and white circle red truck and black car no passing
red and white triangle road intersection warning
white and yellow diamond priority road
red and white upside down triangle yield right-of-way
stop
empty red and white circle
red and white circle no truck entry
red circle with white horizonal stripe no entry
red and white triangle with exclamation mark warning
red and white triangle with black left curve approaching warning
red and white triangle with black right curve approaching warning
red and white triangle with black double curve approaching warning
red and white triangle rough / bumpy road warning
red and white triangle car skidding / slipping warning
red and white triangle with merging / narrow lanes warning
red and white triangle with person digging / construction / road work warning
red and white triangle with traffic light approaching warning
red and white triangle with person walking warning
red and white triangle with child and person walking warning
red and white triangle with bicyle warning
red and white triangle with snowflake / ice warning
red and white triangle with deer warning
white circle with gray strike bar no speed limit
blue circle with white right turn arrow mandatory
blue circle with white left turn arrow mandatory
blue circle with white forward arrow mandatory
blue circle with white forward or right turn arrow mandatory
blue circle with white forward or left turn arrow mandatory
blue circle with white keep right arrow mandatory
blue circle with white keep left arrow mandatory
blue circle with white arrows indicating a traffic circle
white circle with gray strike bar indicating no passing for cars has ended
white circle with gray strike bar indicating no passing for trucks has ended""".splitlines()
)

# Stanford Cars classes 1-196 (cars_meta.mat order).
CARS = tuple(
    """AM General Hummer SUV 2000
Acura RL Sedan 2012
Acura TL Sedan 2012
Acura TL Type-S 2008
Acura TSX Sedan 2012
Acura Integra Type R 2001
Acura ZDX Hatchback 2012
Aston Martin V8 Vantage Convertible 2012
Aston Martin V8 Vantage Coupe 2012
Aston Martin Virage Convertible 2012
Aston Martin Virage Coupe 2012
Audi RS 4 Convertible 2008
Audi A5 Coupe 2012
Audi TTS Coupe 2012
Audi R8 Coupe 2012
Audi V8 Sedan 1994
Audi 100 Sedan 1994
Audi 100 Wagon 1994
Audi TT Hatchback 2011
Audi S6 Sedan 2011
Audi S5 Convertible 2012
Audi S5 Coupe 2012
Audi S4 Sedan 2012
Audi S4 Sedan 2007
Audi TT RS Coupe 2012
BMW ActiveHybrid 5 Sedan 2012
BMW 1 Series Convertible 2012
BMW 1 Series Coupe 2012
BMW 3 Series Sedan 2012
BMW 3 Series Wagon 2012
BMW 6 Series Convertible 2007
BMW X5 SUV 2007
BMW X6 SUV 2012
BMW M3 Coupe 2012
BMW M5 Sedan 2010
BMW M6 Convertible 2010
BMW X3 SUV 2012
BMW Z4 Convertible 2012
Bentley Continental Supersports Conv. Convertible 2012
Bentley Arnage Sedan 2009
Bentley Mulsanne Sedan 2011
Bentley Continental GT Coupe 2012
Bentley Continental GT Coupe 2007
Bentley Continental Flying Spur Sedan 2007
Bugatti Veyron 16.4 Convertible 2009
Bugatti Veyron 16.4 Coupe 2009
Buick Regal GS 2012
Buick Rainier SUV 2007
Buick Verano Sedan 2012
Buick Enclave SUV 2012
Cadillac CTS-V Sedan 2012
Cadillac SRX SUV 2012
Cadillac Escalade EXT Crew Cab 2007
Chevrolet Silverado 1500 Hybrid Crew Cab 2012
Chevrolet Corvette Convertible 2012
Chevrolet Corvette ZR1 2012
Chevrolet Corvette Ron Fellows Edition Z06 2007
Chevrolet Traverse SUV 2012
Chevrolet Camaro Convertible 2012
Chevrolet HHR SS 2010
Chevrolet Impala Sedan 2007
Chevrolet Tahoe Hybrid SUV 2012
Chevrolet Sonic Sedan 2012
Chevrolet Express Cargo Van 2007
Chevrolet Avalanche Crew Cab 2012
Chevrolet Cobalt SS 2010
Chevrolet Malibu Hybrid Sedan 2010
Chevrolet TrailBlazer SS 2009
Chevrolet Silverado 2500HD Regular Cab 2012
Chevrolet Silverado 1500 Classic Extended Cab 2007
Chevrolet Express Van 2007
Chevrolet Monte Carlo Coupe 2007
Chevrolet Malibu Sedan 2007
Chevrolet Silverado 1500 Extended Cab 2012
Chevrolet Silverado 1500 Regular Cab 2012
Chrysler Aspen SUV 2009
Chrysler Sebring Convertible 2010
Chrysler Town and Country Minivan 2012
Chrysler 300 SRT-8 2010
Chrysler Crossfire Convertible 2008
Chrysler PT Cruiser Convertible 2008
Daewoo Nubira Wagon 2002
Dodge Caliber Wagon 2012
Dodge Caliber Wagon 2007
Dodge Caravan Minivan 1997
Dodge Ram Pickup 3500 Crew Cab 2010
Dodge Ram Pickup 3500 Quad Cab 2009
Dodge Sprinter Cargo Van 2009
Dodge Journey SUV 2012
Dodge Dakota Crew Cab 2010
Dodge Dakota Club Cab 2007
Dodge Magnum Wagon 2008
Dodge Challenger SRT8 2011
Dodge Durango SUV 2012
Dodge Durango SUV 2007
Dodge Charger Sedan 2012
Dodge Charger SRT-8 2009
Eagle Talon Hatchback 1998
FIAT 500 Abarth 2012
FIAT 500 Convertible 2012
Ferrari FF Coupe 2012
Ferrari California Convertible 2012
Ferrari 458 Italia Convertible 2012
Ferrari 458 Italia Coupe 2012
Fisker Karma Sedan 2012
Ford F-450 Super Duty Crew Cab 2012
Ford Mustang Convertible 2007
Ford Freestar Minivan 2007
Ford Expedition EL SUV 2009
Ford Edge SUV 2012
Ford Ranger SuperCab 2011
Ford GT Coupe 2006
Ford F-150 Regular Cab 2012
Ford F-150 Regular Cab 2007
Ford Focus Sedan 2007
Ford E-Series Wagon Van 2012
Ford Fiesta Sedan 2012
GMC Terrain SUV 2012
GMC Savana Van 2012
GMC Yukon Hybrid SUV 2012
GMC Acadia SUV 2012
GMC Canyon Extended Cab 2012
Geo Metro Convertible 1993
HUMMER H3T Crew Cab 2010
HUMMER H2 SUT Crew Cab 2009
Honda Odyssey Minivan 2012
Honda Odyssey Minivan 2007
Honda Accord Coupe 2012
Honda Accord Sedan 2012
Hyundai Veloster Hatchback 2012
Hyundai Santa Fe SUV 2012
Hyundai Tucson SUV 2012
Hyundai Veracruz SUV 2012
Hyundai Sonata Hybrid Sedan 2012
Hyundai Elantra Sedan 2007
Hyundai Accent Sedan 2012
Hyundai Genesis Sedan 2012
Hyundai Sonata Sedan 2012
Hyundai Elantra Touring Hatchback 2012
Hyundai Azera Sedan 2012
Infiniti G Coupe IPL 2012
Infiniti QX56 SUV 2011
Isuzu Ascender SUV 2008
Jaguar XK XKR 2012
Jeep Patriot SUV 2012
Jeep Wrangler SUV 2012
Jeep Liberty SUV 2012
Jeep Grand Cherokee SUV 2012
Jeep Compass SUV 2012
Lamborghini Reventon Coupe 2008
Lamborghini Aventador Coupe 2012
Lamborghini Gallardo LP 570-4 Superleggera 2012
Lamborghini Diablo Coupe 2001
Land Rover Range Rover SUV 2012
Land Rover LR2 SUV 2012
Lincoln Town Car Sedan 2011
MINI Cooper Roadster Convertible 2012
Maybach Landaulet Convertible 2012
Mazda Tribute SUV 2011
McLaren MP4-12C Coupe 2012
Mercedes-Benz 300-Class Convertible 1993
Mercedes-Benz C-Class Sedan 2012
Mercedes-Benz SL-Class Coupe 2009
Mercedes-Benz E-Class Sedan 2012
Mercedes-Benz S-Class Sedan 2012
Mercedes-Benz Sprinter Van 2012
Mitsubishi Lancer Sedan 2012
Nissan Leaf Hatchback 2012
Nissan NV Passenger Van 2012
Nissan Juke Hatchback 2012
Nissan 240SX Coupe 1998
Plymouth Neon Coupe 1999
Porsche Panamera Sedan 2012
Ram C/V Cargo Van Minivan 2012
Rolls-Royce Phantom Drophead Coupe Convertible 2012
Rolls-Royce Ghost Sedan 2012
Rolls-Royce Phantom Sedan 2012
Scion xD Hatchback 2012
Spyker C8 Convertible 2009
Spyker C8 Coupe 2009
Suzuki Aerio Sedan 2007
Suzuki Kizashi Sedan 2012
Suzuki SX4 Hatchback 2012
Suzuki SX4 Sedan 2012
Tesla Model S Sedan 2012
Toyota Sequoia SUV 2012
Toyota Camry Sedan 2012
Toyota Corolla Sedan 2012
Toyota 4Runner SUV 2012
Volkswagen Golf Hatchback 2012
Volkswagen Golf Hatchback 1991
Volkswagen Beetle Hatchback 2012
Volvo C30 Hatchback 2012
Volvo 240 Sedan 1993
Volvo XC90 SUV 2007
smart fortwo Convertible 2012""".splitlines()
)

FLOWERS102 = tuple(
    """pink primrose|hard-leaved pocket orchid|canterbury bells|sweet pea|english marigold|tiger lily|moon orchid|
bird of paradise|monkshood|globe thistle|snapdragon|colt's foot|king protea|spear thistle|yellow iris|globe flower|
purple coneflower|peruvian lily|balloon flower|giant white arum lily|fire lily|pincushion flower|fritillary|
red ginger|grape hyacinth|corn poppy|prince of wales feathers|stemless gentian|artichoke|sweet william|carnation|
garden phlox|love in the mist|mexican aster|alpine sea holly|ruby-lipped cattleya|cape flower|great masterwort|
siam tulip|lenten rose|barbeton daisy|daffodil|sword lily|poinsettia|bolero deep blue|wallflower|marigold|buttercup|
oxeye daisy|common dandelion|petunia|wild pansy|primula|sunflower|pelargonium|bishop of llandaff|gaura|geranium|
orange dahlia|pink and yellow dahlia|cautleya spicata|japanese anemone|black-eyed susan|silverbush|californian poppy|
osteospermum|spring crocus|bearded iris|windflower|tree poppy|gazania|azalea|water lily|rose|thorn apple|
morning glory|passion flower|lotus|toad lily|anthurium|frangipani|clematis|hibiscus|columbine|desert-rose|
tree mallow|magnolia|cyclamen|watercress|canna lily|hippeastrum|bee balm|air plant|foxglove|bougainvillea|camellia|
mallow|mexican petunia|bromelia|blanket flower|trumpet creeper|blackberry lily""".replace("\n", "").split("|")
)

# Oxford-IIIT Pet classes 1-37 (the dataset's class ids, which torchvision uses as labels), written
# as torchvision names them (the loader checks that the two agree).
OXFORD_PETS = tuple(
    """Abyssinian|American Bulldog|American Pit Bull Terrier|Basset Hound|Beagle|Bengal|Birman|Bombay|Boxer|
British Shorthair|Chihuahua|Egyptian Mau|English Cocker Spaniel|English Setter|German Shorthaired|Great Pyrenees|
Havanese|Japanese Chin|Keeshond|Leonberger|Maine Coon|Miniature Pinscher|Newfoundland|Persian|Pomeranian|Pug|
Ragdoll|Russian Blue|Saint Bernard|Samoyed|Scottish Terrier|Shiba Inu|Siamese|Sphynx|Staffordshire Bull Terrier|
Wheaten Terrier|Yorkshire Terrier""".replace("\n", "").split("|")
)

PCAM = ("lymph node", "lymph node containing metastatic tumor tissue")

# FER2013 labels 0-6 (angry, disgust, fear, happy, sad, surprise, neutral), CLIP's first name of each.
FER2013 = ("angry", "disgusted", "fearful", "happy", "sad", "surprised", "neutral")

# Food-101 classes in torchvision's label order (sorted folder names, "_" written as a space).
FOOD101 = tuple(
    """apple pie|baby back ribs|baklava|beef carpaccio|beef tartare|beet salad|beignets|bibimbap|bread pudding|
breakfast burrito|bruschetta|caesar salad|cannoli|caprese salad|carrot cake|ceviche|cheese plate|cheesecake|
chicken curry|chicken quesadilla|chicken wings|chocolate cake|chocolate mousse|churros|clam chowder|club sandwich|
crab cakes|creme brulee|croque madame|cup cakes|deviled eggs|donuts|dumplings|edamame|eggs benedict|escargots|
falafel|filet mignon|fish and chips|foie gras|french fries|french onion soup|french toast|fried calamari|fried rice|
frozen yogurt|garlic bread|gnocchi|greek salad|grilled cheese sandwich|grilled salmon|guacamole|gyoza|hamburger|
hot and sour soup|hot dog|huevos rancheros|hummus|ice cream|lasagna|lobster bisque|lobster roll sandwich|
macaroni and cheese|macarons|miso soup|mussels|nachos|omelette|onion rings|oysters|pad thai|paella|pancakes|
panna cotta|peking duck|pho|pizza|pork chop|poutine|prime rib|pulled pork sandwich|ramen|ravioli|red velvet cake|
risotto|samosa|sashimi|scallops|seaweed salad|shrimp and grits|spaghetti bolognese|spaghetti carbonara|spring rolls|
steak|strawberry shortcake|sushi|tacos|takoyaki|tiramisu|tuna tartare|waffles""".replace("\n", "").split("|")
)

FASHION_MNIST = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

RENDERED_SST2 = ("negative", "positive")

# KMNIST's ten hiragana, romanised as torchvision names them.
KMNIST = ("o", "ki", "su", "tsu", "na", "ha", "ma", "ya", "re", "wo")
